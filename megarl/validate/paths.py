"""`megarl validate`'s rules for the files and directories a recipe names.

Every input a command of the recipe reads must exist on this machine, unless megarl makes it before reading it (a
tiny model from model.create_tiny, synthetic data, the SFT warm-start of sft.enable, `megarl rm`'s preference pairs).
A missing input names the megarl command that writes it, found among this recipe's own outputs and the recipes in
./recipes and megarl's recipes directory (e.g. the reward model of recipes/ppo_rm_tiny_cpu.yaml is written by
`megarl rm recipes/rm_tiny_cpu.yaml`). With model.config_path set the recipe may be validated for another machine,
so missing inputs are warnings there. A model directory that exists is opened as the loaders open it
(megarl.bridge.hf_config.load_spec): a config.json that does not parse, an index naming a missing shard or a truncated
safetensors file is refused naming the file, on any machine; so is one whose tokenizer a command reads when it has
none, and a GGUF file (or a directory of one) in place of a Hugging Face directory.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pydantic import ValidationError

from megarl.bridge.hf_config import (CONFIG_FILE, INDEX_FILE, ModelFileError, check_weight_files,
                                     read_config_json)
from megarl.checkpoint.locate import resolve_resume
from megarl.config.issues import ConfigError, Issue
from megarl.config.loader import read_recipe
from megarl.config.outputs import (pair_paths, policy_pair_paths, rm_output_dir, sft_output_dir,
                                   synthetic_paths)
from megarl.config.schema import MegarlConfig
from megarl.config.sources import absolute as _abs, maker_of

MODEL = "model"  # a Hugging Face model directory megarl loads into megatron: config.json and safetensors weights
ENGINE_MODEL = "engine model"  # a model directory only the vLLM engine loads (the judge): config.json
TOKENIZER = "tokenizer"
FILE = "file"
CHECKPOINT = "checkpoint"
HF_DIR_FIX = ("point it at a local Hugging Face model directory (config.json, *.safetensors, tokenizer), e.g. "
              "`huggingface-cli download NAME --local-dir DIR`")
# What AutoTokenizer finds a tokenizer by, looked for by name only: a directory with none of them is the case to
# catch, where transformers falls back to a slow tokenizer class and fails inside sentencepiece on rank 0.
TOKENIZER_FILES = "tokenizer.json, tokenizer.model, or tokenizer_config.json with vocab.json + merges.txt"
COPY_TOKENIZER = "copy the tokenizer files (e.g. tokenizer.json, tokenizer_config.json) from the original model into it"
GGUF_RULE = "megarl needs a Hugging Face directory (config.json, safetensors, tokenizer)"


def gguf_fix(gguf: Path) -> str:
    return ("convert it into a directory DIR and point the key at DIR: `megarl get-model smollm2-135m-instruct --out "
            "DIR` for SmolLM2-135M-Instruct; any model with transformers: AutoModelForCausalLM.from_pretrained("
            f"{str(gguf.parent)!r}, gguf_file={gguf.name!r}) and AutoTokenizer the same way, then save_pretrained(DIR) "
            "on both")


@dataclass(frozen=True)
class PathIssue(Issue):
    """An Issue about a file or directory of this machine. Tools that write recipes for another machine (convert-verl)
    set these aside: they say where the recipe runs, not what it asks for."""


@dataclass(frozen=True)
class Input:
    key: str
    value: str
    kind: str
    fix: str  # what to do when it is missing and no megarl command is known to write it
    tokenizer_fix: str = ""  # a model directory whose tokenizer a command loads: what to do when it has none


def _data_inputs(cfg: MegarlConfig) -> list[Input]:
    fix = "point it at an existing .parquet or .jsonl file"
    lists = (("data.train_files", cfg.data.train_files, fix + ", or leave the list empty with data.synthetic set"),
             ("data.val_files", cfg.data.val_files, fix + ", or leave the list empty with data.synthetic set"),
             ("sft.train_files", cfg.sft.train_files, fix + " of prompt/response rows"),
             ("rm.train_files", cfg.rm.train_files, fix + " of preference pairs, or leave the list empty with "
              "data.synthetic set"),
             ("rm.val_files", cfg.rm.val_files, fix + " of preference pairs"))
    return [Input(f"{key}[{i}]", f, FILE, why) for key, files, why in lists for i, f in enumerate(files)]


def inputs(cfg: MegarlConfig) -> list[Input]:
    """Every path the recipe's commands read, where its settings make them read it."""
    r, found = cfg.reward, []
    # Whose tokenizer is loaded from the directory itself. model.path's always: the rollout engine (vLLM) is given
    # model.path alone and loads its tokenizer there, and `megarl sft` copies model.path's tokenizer files (not
    # model.tokenizer_path's) into the model RL then starts from. The critic and the teacher use the policy's tokenizer.
    own_tokenizer = {
        "model.path": COPY_TOKENIZER + "; model.tokenizer_path does not replace them: the rollout engine loads the "
                      "tokenizer from model.path",
        "reward.reward_model.path": COPY_TOKENIZER + " (the reward model reads with its own tokenizer)",
        "rm.model_path": "" if cfg.model.tokenizer_path else COPY_TOKENIZER + ", or set model.tokenizer_path to a "
                         "directory that has them",
        "sft.output_dir": COPY_TOKENIZER,
    }
    models = (
        ("model.path", cfg.model.path, True, HF_DIR_FIX + ", or add model.create_tiny to create a tiny random model "
         "there" + ("" if cfg.model.config_path else "; to validate for another machine set model.config_path to "
                    "the model's config.json")),
        ("critic.model_path", cfg.critic.model_path, cfg.critic_enabled, HF_DIR_FIX + ", or unset it (the critic "
         "starts from the model RL starts from)"),
        ("distillation.teacher.path", cfg.distillation.teacher.path, cfg.distillation.enable, "point it at the "
         "teacher's Hugging Face model directory (a megarl run's checkpoint becomes one with `megarl merge --ckpt "
         "RUN_DIR/checkpoints/step_N --out DIR`)"),
        ("reward.reward_model.path", r.reward_model.path, r.reward_model.enable, "train it with `megarl rm RECIPE` "
         "(it writes rm.output_dir, default <trainer.run_dir>/rm_model), or fix the path"),
        ("rm.model_path", cfg.rm.model_path, True, HF_DIR_FIX + ", or unset it (the SFT output with sft.enable, "
         "else model.path)"),
        ("sft.output_dir", str(sft_output_dir(cfg)), cfg.sft.enable, ""),  # read back when it exists
    )
    found += [Input(key, value, MODEL, fix, own_tokenizer.get(key, "")) for key, value, read, fix in models
              if value and read]
    if r.judge.enable and r.judge.path:
        found.append(Input("reward.judge.path", r.judge.path, ENGINE_MODEL, HF_DIR_FIX, COPY_TOKENIZER))
    if cfg.model.tokenizer_path:
        found.append(Input("model.tokenizer_path", cfg.model.tokenizer_path, TOKENIZER, "point it at a tokenizer "
                           "directory (tokenizer.json, tokenizer_config.json), or unset it (model.path's tokenizer)"))
    mt = cfg.rollout.multi_turn
    if mt.enable and mt.tool_config_path:
        found.append(Input("rollout.multi_turn.tool_config_path", mt.tool_config_path, FILE, "point it at a YAML "
                           "file with a 'tools:' list (see docs/multiturn.md)"))
    if cfg.checkpoint.resume not in ("auto", "disable"):
        found.append(Input("checkpoint.resume", cfg.checkpoint.resume, CHECKPOINT, "pass a run directory or a "
                           "complete <run_dir>/checkpoints/step_<N> (what `megarl train` or `megarl import` writes), "
                           "auto (the latest in trainer.run_dir) or disable"))
    return found + _data_inputs(cfg)


def written(cfg: MegarlConfig) -> list[tuple[Path, str]]:
    """(path, megarl command) for each path the recipe's commands write."""
    run = Path(cfg.trainer.run_dir)
    out = [(run, "train"), (run / "checkpoints", "train"), (sft_output_dir(cfg), "sft"), (rm_output_dir(cfg), "rm")]
    if cfg.model.create_tiny is not None and cfg.model.path:
        out.append((Path(cfg.model.path), "train"))
    if cfg.data.synthetic is not None:
        out += [(p, "train") for p in synthetic_paths(cfg).values()]
        out += [(p, "rm") for p in (*pair_paths(cfg).values(), *policy_pair_paths(cfg).values())]
    return out


def made_by_run(cfg: MegarlConfig) -> set[Path]:
    """What a command of this recipe makes before it reads it (megarl.prepare, the SFT warm-start, `megarl rm`'s
    pairs), absolute."""

    made = []
    if cfg.model.create_tiny is not None and cfg.model.path:
        made.append(Path(cfg.model.path))
    if cfg.sft.enable:
        made.append(sft_output_dir(cfg))
    if cfg.data.synthetic is not None:
        made += list(synthetic_paths(cfg).values())
        if not cfg.rm.train_files:
            made += list(pair_paths(cfg).values())
        if cfg.rm.policy_pairs.enable:
            made += list(policy_pair_paths(cfg).values())
    return {_abs(p) for p in made}


def recipe_dirs() -> list[Path]:
    """Where the recipes that may write an input are looked for: ./recipes, then megarl's own."""
    dirs = [Path("recipes"), Path(__file__).resolve().parents[2] / "recipes"]
    seen, out = set(), []
    for d in dirs:
        if d.is_dir() and d.resolve() not in seen:
            seen.add(d.resolve())
            out.append(d)
    return out


def _recipes():
    """(shown path, config) of each recipe in recipe_dirs() that loads (schema only, no checks)."""
    for d in recipe_dirs():
        for path in sorted(d.glob("*.yaml")):
            try:
                cfg = MegarlConfig.model_validate(read_recipe(path))
            except (ConfigError, ValidationError):
                continue
            shown = os.path.relpath(path)
            yield (str(path.resolve()) if shown.startswith("..") else shown), cfg


def writer(path: str, kind: str, cfg: MegarlConfig) -> Optional[str]:
    """The command that writes `path` ("`megarl rm recipes/rm_tiny_cpu.yaml`", "`megarl get-model NAME`"), or None."""
    target = _abs(path)
    made = maker_of(path)
    if made:
        return made
    for p, command in written(cfg):
        if _abs(p) == target:
            return f"`megarl {command}` with this recipe"
    recipes = list(_recipes())
    for shown, other in recipes:
        for p, command in written(other):
            if _abs(p) == target:
                return f"`megarl {command} {shown}`"
    if kind == MODEL:  # a directory beside a run's checkpoints: an HF model merged from them
        for shown, other in recipes:
            run = Path(other.trainer.run_dir)
            if _abs(run) == target.parent:
                return (f"`megarl train {shown}` then `megarl merge --ckpt {run / 'checkpoints'}/step_"
                        f"{other.trainer.total_steps} --out {path}`")
    return None


def for_another_machine(cfg: MegarlConfig) -> str:
    """Why the recipe may be validated for another machine ("" if it is for this one): it gives the model's shape in
    model.config_path, or asks for CUDA where there is none."""
    if cfg.model.config_path:
        return "model.config_path is set"
    if cfg.trainer.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "trainer.device=cuda and this machine has no CUDA device"
    return ""


def _missing(item: Input, cfg: MegarlConfig) -> Issue:
    what = {MODEL: "directory", ENGINE_MODEL: "directory", TOKENIZER: "directory", FILE: "file",
            CHECKPOINT: "path"}[item.kind]
    command = writer(item.value, item.kind, cfg)
    fix = f"first run {command}, which writes it; or fix the path" if command else item.fix
    elsewhere = for_another_machine(cfg)
    if elsewhere:
        return PathIssue(item.key, item.value, f"no such {what} on this machine (a warning: {elsewhere}, so the "
                         "recipe may be for another machine; a run here would stop at it)", fix, keys=(item.key,),
                         warning=True)
    where = "" if os.path.isabs(item.value) else f" (relative paths start at {os.getcwd()})"
    return PathIssue(item.key, item.value, f"no such {what}{where}, and this run does not create it", fix,
                     keys=(item.key,))


def has_tokenizer(path: Path) -> bool:
    names = {p.name for p in path.iterdir()}
    if names & {"tokenizer.json", "tokenizer.model", "vocab.txt"} or {"vocab.json", "merges.txt"} <= names:
        return True
    # other sentencepiece/tiktoken file names, and tokenizers of their own code (auto_map) that name their own files
    if any(n.endswith((".model", ".tiktoken")) for n in names):
        return True
    if "tokenizer_config.json" in names:
        try:
            return "auto_map" in read_config_json(path / "tokenizer_config.json")
        except ModelFileError:
            return False
    return False


def model_dir_problem(path: Path, kind: str, tokenizer_fix: str = ""):
    """None, or (file, what is wrong, fix) of a model directory as the loaders would open it. tokenizer_fix: the
    directory's own tokenizer is loaded, and this is what to do when it has none."""
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else [path] if path.suffix.lower() == ".gguf" else []
    if path.is_file() and ggufs:
        return path, f"is a GGUF file; {GGUF_RULE}", gguf_fix(path)
    if not path.is_dir():
        return path, "is a file, not a model directory", "point it at the directory that holds config.json"
    # a model downloaded as GGUF (a llama.cpp package): megarl's loaders and the engine read HF directories only
    gguf = f"holds a GGUF file ({ggufs[0].name}) and {{}}; {GGUF_RULE}" if ggufs else ""
    if not (path / CONFIG_FILE).is_file():
        if gguf:
            return path, gguf.format("no config.json"), gguf_fix(ggufs[0])
        return path, "not a Hugging Face model directory: it has no config.json", HF_DIR_FIX
    try:
        read_config_json(path / CONFIG_FILE)
        check_weight_files(path)
    except ModelFileError as exc:
        return exc.file, exc.problem, exc.fix
    if kind == MODEL and not (path / INDEX_FILE).is_file() and not any(path.glob("*.safetensors")):
        if gguf:
            return path, gguf.format("no *.safetensors weights"), gguf_fix(ggufs[0])
        return path, "has no *.safetensors weights (megarl loads safetensors checkpoints only)", (
            "download the model's safetensors files, or convert its weights to safetensors")
    if tokenizer_fix and not has_tokenizer(path):
        return path, f"has config.json and weights but no tokenizer (expected {TOKENIZER_FILES})", tokenizer_fix
    return None


def _present(item: Input, cfg: MegarlConfig, made: set) -> Optional[Issue]:
    path = Path(item.value)
    if item.kind in (MODEL, ENGINE_MODEL):
        problem = model_dir_problem(path, item.kind, item.tokenizer_fix)
        if problem is None:
            return None
        file, what, fix = problem
        what = what if Path(file) == path else f"{file}: {what}"
        if _abs(path) in made:
            fix = "delete the directory: the run makes it again"
        elif (command := writer(item.value, item.kind, cfg)) is not None:
            fix = f"delete the directory and run {command} again"
        return PathIssue(item.key, item.value, what, fix, keys=(item.key,))
    if item.kind == TOKENIZER and not path.is_dir():
        return PathIssue(item.key, item.value, "is a file, not a tokenizer directory", item.fix, keys=(item.key,))
    if item.kind == FILE and path.is_dir() and item.key == "rollout.multi_turn.tool_config_path":
        return PathIssue(item.key, item.value, "is a directory, not a YAML file", item.fix, keys=(item.key,))
    if item.kind == CHECKPOINT:
        try:
            resolve_resume(item.value, cfg.trainer.run_dir)
        except ValueError as exc:
            return PathIssue(item.key, item.value, str(exc).removeprefix(f"checkpoint.resume={item.value!r} "),
                             keys=(item.key,))
    return None


def _output_issues(cfg: MegarlConfig) -> list[Issue]:
    """Directories megarl writes: a file in the way would fail the run after its first steps."""
    syn = cfg.data.synthetic
    outputs = (("trainer.run_dir", cfg.trainer.run_dir), ("sft.output_dir", cfg.sft.output_dir),
               ("rm.output_dir", cfg.rm.output_dir), ("data.synthetic.output_dir", syn.output_dir if syn else None))
    return [PathIssue(key, value, "is a file; megarl writes a directory there", "point it at a directory, or move "
                      "the file away", keys=(key,)) for key, value in outputs if value and Path(value).is_file()]


def check_paths(cfg: MegarlConfig) -> list[Issue]:
    """Each input the recipe names exists (or this run makes it first) and each model directory opens whole."""
    made, issues = made_by_run(cfg), _config_path_issues(cfg)
    for item in inputs(cfg):
        if os.path.exists(item.value):
            issue = _present(item, cfg, made)
        else:
            issue = None if _abs(item.value) in made else _missing(item, cfg)
        if issue is not None:
            issues.append(issue)
    return issues + _output_issues(cfg)


def _config_path_issues(cfg: MegarlConfig) -> list[Issue]:
    """model.config_path is read by validate and plan themselves (a missing one: bridge.checks.check_model_source)."""
    path = cfg.model.config_path
    if not path or not Path(path).is_file():
        return []
    try:
        read_config_json(path)
    except ModelFileError as exc:
        return [PathIssue("model.config_path", path, exc.problem, "fix it, or download the model's config.json "
                          "again", keys=("model.config_path",))]
    return []
