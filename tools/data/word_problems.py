#!/usr/bin/env python
"""Arithmetic word problems, generated offline, in GSM8K's prompt shape: a real-model RL run with no download.

    python tools/data/word_problems.py --out-dir data/word_problems --num-train 2000 --num-val 128 \\
        --steps 1 2 --max-number 20 --seed 0 [--format parquet|jsonl]

    "Tom has 12 apples. He buys 5 more apples. Then he gives 3 apples to his sister.
     How many apples does Tom have now?"                                                  ground_truth "14"

A problem is a start sentence and 1 to 3 operations (--steps picks which counts), each written by one sentence
template of its kind: add (buys, finds, is given ... more), sub (gives away, eats, loses ...), mul (N boxes with M
in each) and div (packs into boxes of M, shares equally; exact divisions only). Operands are 1..--max-number,
factors and divisors 2..min(12, --max-number); every intermediate value is a non-negative integer.

Three files, rows as tools/data/prompt_rows.py lays them out (data_source "openai/gsm8k", so megarl's gsm8k rule
scores them), extra_info also holding split, steps, start, operations and template_ids:

    train       templates not held out
    val         the same templates, another seed, no question identical to a train question
    val_unseen  only the held-out templates (HELD_OUT, two of every kind): does the policy generalise past wording?

Deterministic for a seed; each split draws from its own stream, so --num-train does not change the val files.
"""
from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prompt_rows import FORMATS, PrepError, prompt_row, write_split  # noqa: E402

MAX_STEPS = 3
SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
MAX_FACTOR = 12  # times tables: products and quotients a person checks in their head

# What a sentence counts after it: loose items ("apples"), containers of them ("baskets"), or one share of a
# division among people (only as the last operation: nothing a person does afterwards reads naturally).
ITEM, CONTAINER, SHARE = "item", "container", "share"


@dataclass(frozen=True)
class Template:
    """One sentence form. needs: the counted thing it applies to (None: any but SHARE); gives: what is counted after
    it (None: unchanged); then: may start with 'Then', 'After that,' ... when it is not the first operation."""
    id: str
    kind: str
    text: str
    needs: Optional[str] = None
    gives: Optional[str] = None
    then: bool = True


TEMPLATES = [
    Template("start_has", "start", "{Name} has {n} {things}."),
    Template("start_brings", "start", "{Name} brings {n} {things} to the picnic."),
    Template("start_keeps", "start", "{Name} keeps {n} {things} in the pantry."),
    Template("start_there", "start", "There are {n} {things} in {Name}'s kitchen."),
    Template("start_begins", "start", "{Name} starts the week with {n} {things}."),

    Template("add_buy", "add", "{Subj} buys {n} more {things}."),
    Template("add_gift", "add", "{Pos} {relative} gives {obj} {n} {things}."),
    Template("add_find", "add", "{Subj} finds {n} more {things} {place}."),
    Template("add_receive", "add", "{Subj} receives {n} {things} as a present."),
    Template("add_collect", "add", "{Subj} collects {n} more {things} on {day}."),
    Template("add_bring", "add", "{Pos} {relative} brings {obj} {n} more {things}."),
    Template("add_win", "add", "{Subj} wins {n} {things} at the school fair."),
    Template("add_order", "add", "{Subj} orders {n} more {things}, and they arrive the next day."),

    Template("sub_give", "sub", "{Subj} gives {n} {things} to {pos} {relative}."),
    Template("sub_eat", "sub", "{Subj} eats {n} of the {counted}.", needs=ITEM),
    Template("sub_lose", "sub", "{Subj} loses {n} {things} on the way home."),
    Template("sub_giveaway", "sub", "{Subj} gives away {n} {things}."),
    Template("sub_spoil", "sub", "{Subj} throws away {n} {things} that went bad.", needs=ITEM),
    Template("sub_sell", "sub", "{Subj} sells {n} {things} at the market."),
    Template("sub_donate", "sub", "{Subj} donates {n} {things} to the food bank."),

    # N containers -> N * M items: the counted thing becomes the items
    Template("mul_holds", "mul", "Each {container} holds {n} {items}.", needs=CONTAINER, gives=ITEM, then=False),
    Template("mul_there", "mul", "There are {n} {items} in every {container}.", needs=CONTAINER, gives=ITEM,
             then=False),
    Template("mul_contains", "mul", "Every {container} contains {n} {items}.", needs=CONTAINER, gives=ITEM,
             then=False),
    Template("mul_filled", "mul", "Each of the {containers} is filled with {n} {items}.", needs=CONTAINER,
             gives=ITEM, then=False),
    Template("mul_fills", "mul", "{Subj} fills each {container} with {n} {items}.", needs=CONTAINER, gives=ITEM),
    Template("mul_inside", "mul", "Each {container} has {n} {items} inside.", needs=CONTAINER, gives=ITEM,
             then=False),
    Template("mul_packed", "mul", "The {containers} are packed with {n} {items} each.", needs=CONTAINER,
             gives=ITEM, then=False),

    # N items -> N / M: containers of M, one of M equal shares, or one of M piles kept
    Template("div_pack", "div", "{Subj} packs the {items} into {containers} of {n}.", needs=ITEM, gives=CONTAINER),
    Template("div_put", "div", "{Subj} puts the {items} into {containers}, {n} in each {container}.", needs=ITEM,
             gives=CONTAINER),
    Template("div_fill", "div", "{Subj} uses all the {items} to fill {containers}, with {n} in each {container}.",
             needs=ITEM, gives=CONTAINER),
    Template("div_share", "div", "{Subj} shares the {items} equally among {n} {people}.", needs=ITEM, gives=SHARE),
    Template("div_keep", "div", "{Subj} divides the {items} into {n} equal piles and keeps one pile.", needs=ITEM),
    Template("div_group", "div", "{Subj} sorts the {items} into groups of {n} and puts each group in a {container}.",
             needs=ITEM, gives=CONTAINER),
    Template("div_split", "div", "{Subj} splits the {items} equally between {n} {people}.", needs=ITEM, gives=SHARE),
]
KINDS = ("start", "add", "sub", "mul", "div")
# val_unseen's templates, two of every kind, never in train or val. Each kind keeps templates for every counted thing
# on both sides (a div to containers and one to shares; subs that apply to containers), so both sides make all shapes.
HELD_OUT = frozenset({"start_there", "start_begins", "add_win", "add_order", "sub_sell", "sub_donate",
                      "mul_inside", "mul_packed", "div_group", "div_split"})
SPLITS = {"train": False, "val": False, "val_unseen": True}  # split -> uses the held-out templates

NAMES = [("Tom", "he"), ("Mia", "she"), ("Liam", "he"), ("Ava", "she"), ("Noah", "he"), ("Emma", "she"),
         ("Omar", "he"), ("Sofia", "she"), ("Kenji", "he"), ("Priya", "she"), ("Lucas", "he"), ("Zoe", "she")]
PRONOUNS = {"he": ("he", "him", "his"), "she": ("she", "her", "her")}
# (item, items, container, containers)
GOODS = [("apple", "apples", "basket", "baskets"), ("orange", "oranges", "crate", "crates"),
         ("cookie", "cookies", "jar", "jars"), ("muffin", "muffins", "tray", "trays"),
         ("egg", "eggs", "carton", "cartons"), ("candy", "candies", "bag", "bags"),
         ("cupcake", "cupcakes", "box", "boxes"), ("plum", "plums", "bowl", "bowls"),
         ("cracker", "crackers", "pack", "packs"), ("lemon", "lemons", "sack", "sacks")]
RELATIVES = ["sister", "brother", "cousin", "neighbor", "friend", "grandmother", "uncle"]
PLACES = ["in the kitchen", "in the garden shed", "at the back of the cupboard", "in the car"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
PEOPLE = [("friend", "friends"), ("classmate", "classmates"), ("neighbor", "neighbors"), ("child", "children"),
          ("teammate", "teammates")]
CONNECTORS = ["Then ", "After that, ", "Later, ", ""]


def templates_for(held_out: bool) -> list[Template]:
    """The templates of one side of the split: the held-out ones, or all the others."""
    return [t for t in TEMPLATES if (t.id in HELD_OUT) == held_out]


def apply_op(op: str, x: int, n: int) -> int:
    """x after one operation; raises ValueError where the result would not be a non-negative integer."""
    if op == "add":
        return x + n
    if op == "sub" and n <= x:
        return x - n
    if op == "mul":
        return x * n
    if op == "div" and n > 0 and x % n == 0:
        return x // n
    raise ValueError(f"{op} {n} on {x} leaves no non-negative integer")


def draw_operand(rng: random.Random, kind: str, x: int, max_number: int) -> Optional[int]:
    """An operand for `kind` on the current value x, or None where the kind cannot apply to x (subtracting from 1,
    dividing a number with no divisor in 2..min(12, max_number))."""
    top_factor = min(MAX_FACTOR, max_number)
    if kind == "add":
        return rng.randint(1, max_number)
    if kind == "sub":  # leave at least one, so a later division or "of the apples" still has something to count
        return rng.randint(1, min(max_number, x - 1)) if x >= 2 else None
    if kind == "mul":  # from 2 containers up, so "each of the baskets" has a plural to refer to
        return rng.randint(2, top_factor) if x >= 2 else None
    if kind == "div":
        divisors = [k for k in range(2, min(top_factor, x) + 1) if x % k == 0]
        return rng.choice(divisors) if divisors else None
    raise ValueError(f"unknown operation kind {kind!r}")


def _sentence(template: Template, rng: random.Random, fields: dict[str, Any], n: int, counted: str,
              connector: str = "") -> str:
    """One sentence of a problem: the template with n, the counted noun (singular for n == 1), the problem's
    person and goods, and a fresh relative, place and day."""
    item, items, container, containers = fields["goods"]
    noun = (item, items) if counted == ITEM else (container, containers)
    things = noun[0] if n == 1 else noun[1]
    if template.kind == "start" and counted == CONTAINER:  # say once what the containers hold
        things += f" of {items}"
    text = template.text.format(
        n=n, things=things, counted=noun[1], items=items, container=container,
        containers=containers, people=fields["people"][1], relative=rng.choice(RELATIVES), place=rng.choice(PLACES),
        day=rng.choice(DAYS), Name=fields["Name"], Subj=fields["subj"].capitalize(), obj=fields["obj"],
        pos=fields["pos"], Pos=fields["pos"].capitalize())
    return connector + text[0].lower() + text[1:] if connector else text


def _question(fields: dict[str, Any], counted: str, last_kind: str) -> str:
    _, items, _, containers = fields["goods"]
    if counted == SHARE:
        return f"How many {items} does each {fields['people'][0]} get?"
    if counted == CONTAINER:
        return f"How many {containers} of {items} does {fields['Name']} have now?"
    return f"How many {items} does {fields['Name']} have {'in total' if last_kind == 'mul' else 'now'}?"


def make_problem(rng: random.Random, steps: int, max_number: int, held_out: bool) -> dict[str, Any]:
    """One problem: {"question", "answer" (worked, ending '#### N'), "ground_truth", "start", "operations"
    [{"op", "value"}], "template_ids", "steps"}."""
    templates = templates_for(held_out)
    name, gender = rng.choice(NAMES)
    subj, obj, pos = PRONOUNS[gender]
    fields = {"Name": name, "subj": subj, "obj": obj, "pos": pos, "goods": rng.choice(GOODS),
              "people": rng.choice(PEOPLE)}
    counted = rng.choice([ITEM, CONTAINER])
    x = start = rng.randint(2, max_number)  # from 2: "There are 1 apple" has no grammatical template
    first = rng.choice([t for t in templates if t.kind == "start"])
    sentences, ids, operations, work = [_sentence(first, rng, fields, x, counted)], [first.id], [], []
    last_kind, repacked = "start", False
    for step in range(steps):
        # one change between containers and items per problem: boxes a division filled with 2 each cannot then
        # "hold 8 each", and refilling the baskets a multiplication just filled reads as a riddle
        options = [t for t in templates if t.kind != "start" and t.needs in (None, counted)
                   and (t.gives != SHARE or step == steps - 1) and not (repacked and t.gives in (ITEM, CONTAINER))]
        kinds = sorted({t.kind for t in options})
        rng.shuffle(kinds)
        for kind in kinds:  # "add" applies to any value, so some kind always fits
            n = draw_operand(rng, kind, x, max_number)
            if n is not None:
                break
        template = rng.choice([t for t in options if t.kind == kind])
        connector = rng.choice(CONNECTORS) if step > 0 and template.then else ""
        sentences.append(_sentence(template, rng, fields, n, counted, connector))
        y = apply_op(kind, x, n)
        work.append(f"{x} {SYMBOLS[kind]} {n} = {y}")
        operations.append({"op": kind, "value": n})
        ids.append(template.id)
        repacked = repacked or template.gives in (ITEM, CONTAINER)
        x, counted, last_kind = y, template.gives or counted, kind
    question = " ".join(sentences + [_question(fields, counted, last_kind)])
    return {"question": question, "answer": "\n".join(work + [f"#### {x}"]), "ground_truth": str(x),
            "start": start, "operations": operations, "template_ids": ids, "steps": steps}


def make_split(n: int, seed: int, split: str, steps: Sequence[int] = (1, 2), max_number: int = 20,
               avoid: Collection[str] = ()) -> list[dict[str, Any]]:
    """n prompt rows (prompt_rows.prompt_row) for split "train", "val" or "val_unseen", distinct questions, none in
    `avoid` (pass the train questions for val). The number of operations is drawn uniformly from `steps`.
    extra_info: split, index, question, answer, steps, start, operations [{"op", "value"}], template_ids.
    Raises PrepError for bad arguments or when fewer than n distinct questions turn up."""
    if split not in SPLITS:
        raise PrepError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    bad_steps = [s for s in steps if not 1 <= s <= MAX_STEPS]
    if not steps or bad_steps:
        raise PrepError(f"steps must be a non-empty list of 1..{MAX_STEPS}, got {list(steps)}")
    if max_number < 2:
        raise PrepError(f"max_number must be at least 2 (factors and divisors start at 2), got {max_number}")
    # one stream per split and seed: val does not move when the train size changes
    rng = random.Random(f"megarl-word-problems:{split}:{seed}")
    taken, rows = set(avoid), []
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 50 * n + 1000:
            raise PrepError(f"only {len(rows)} distinct {split} questions in {tries - 1} tries (steps {list(steps)}, "
                            f"max_number {max_number}); ask for fewer rows, or raise --max-number or --steps")
        p = make_problem(rng, rng.choice(list(steps)), max_number, SPLITS[split])
        if p["question"] in taken:
            continue
        taken.add(p["question"])
        rows.append(prompt_row(p["question"], p["ground_truth"], split, len(rows), p["answer"], steps=p["steps"],
                               start=p["start"], operations=p["operations"], template_ids=p["template_ids"]))
    return rows


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True, help="where train, val and val_unseen files go")
    p.add_argument("--num-train", type=int, default=2000)
    p.add_argument("--num-val", type=int, default=128, help="rows in val and in val_unseen each")
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2], choices=range(1, MAX_STEPS + 1),
                   help="how many operations a problem may have (default: 1 2)")
    p.add_argument("--max-number", type=int, default=20, help="largest operand (at least 2; default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=FORMATS, default="parquet", help="output file type (default parquet)")
    args = p.parse_args(argv)
    if args.num_train < 1 or args.num_val < 1:
        p.error(f"--num-train and --num-val must be at least 1, got {args.num_train} and {args.num_val}")
    if args.max_number < 2:
        p.error(f"--max-number must be at least 2 (factors and divisors start at 2), got {args.max_number}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    common = dict(seed=args.seed, steps=sorted(set(args.steps)), max_number=args.max_number)
    try:
        train = make_split(args.num_train, split="train", **common)
        splits = {"train": train,
                  "val": make_split(args.num_val, split="val", avoid={r["extra_info"]["question"] for r in train},
                                    **common),
                  "val_unseen": make_split(args.num_val, split="val_unseen", **common)}
        for name, rows in splits.items():
            path = write_split(rows, args.out_dir, name, args.format)
            per_steps = Counter(r["extra_info"]["steps"] for r in rows)
            counts = ", ".join(f"{per_steps[s]} with {s} step{'s' * (s > 1)}" for s in sorted(per_steps))
            print(f"word_problems: {len(rows)} {name} rows ({counts}) -> {path}")
    except PrepError as e:
        print(f"word_problems.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
