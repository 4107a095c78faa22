"""One file per way of delivering the actor's weights to the engines, all with one interface:

    sync = plan_...(holdings, engine, ...)       # prepare: a collective of every trainer rank, once per run (and
                                                 #   again after an engine restart); compiles what each update copies
    metrics = sync.run(engine, verify=False)     # one update: a collective; `engine` is this rank's engine handle
                                                 #   (None on ranks that hold none); weight_sync/* metrics

* colocated (WeightSync): engines beside the trainer ranks; each worker's pieces from the ranks that hold them, into
  reused bucket files (common) or, where the worker takes them, written in place or pulled by it (placed);
* remote (RemoteSync): engines in processes of their own, over a transfer group, whole or as deltas
  (remote_delta), re-formed after an engine host restarts (`rejoin`); its hosts and metrics in remote_hosts;
* adapter (AdapterSync): only the LoRA adapters, in one adapter file per engine;
* feed (FullTensorFeed): a stream of whole tensors from one process (an engine's own update_weights).

megarl.sync.factory picks one from the recipe; nothing else reads the recipe's sync settings.
"""
