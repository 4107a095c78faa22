"""Where an engine runs when not in the trainer's process: a child process a trainer rank starts (process), Ray
actors (ray), the receiver of weights over the transfer group for engines placed apart (receiver), and the
supervisor that restarts a lost engine (supervisor)."""
