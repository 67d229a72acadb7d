"""``validate_heads``: do the top-scored heads carry the behaviour? Patch them together and
compare with random head sets from the same layers.

For each phase ``P`` (1: Phase-1 task ``task.with_phase(1)``, heads ranked by ``phase1_rank``;
2: ``task.with_phase(2)``, ``phase2_rank``) and each direction (``noise``: the heads' corrupt
``z`` into the clean run; ``denoise``: their clean ``z`` into the corrupt run), the exact
engine (``ExactEngine.run_head_sets``) runs, in the same batched suffix forwards:

* the unpatched base run (the empty set), the top-``k`` set, and ``n_random`` distinct random
  ``k``-sets drawn from the same layers (for each layer holding ``c`` of the top heads, ``c``
  distinct heads of that layer uniformly; a draw equal to the top set or to an earlier draw is
  redrawn; all of them when fewer exist, and ``n_random`` in the frame says how many were used;
  from every layer when the top heads fill their layers: ``random_head_sets``);
* two per-prompt quantities on each: the phase's task metric (``task.prompt_metric()``:
  anchor margin / target-vs-near-miss margin) and its behaviour measure, Reasoning Focus
  (phase 1) or Near-Miss Confusion (phase 2), as defined in ``circuitkit.evaluation``
  (``focus_metric``/``confusion_metric`` below equal ``focus_from_logits``/
  ``confusion_from_logits``, read at the same positions).

Per quantity, with ``d_i = patched_i - base_i`` over prompts ``i``:

* ``top_effect = mean_i d_i`` of the top set; ``top_low``/``top_high``: percentile bootstrap
  95% interval over prompts (``n_boot`` resamples);
* ``random_mean``: mean over random sets and prompts; ``random_low``/``random_high``: the 2.5 and
  97.5 percentiles of a random set's mean effect, pooled over the random sets and the same
  bootstrap resamples of prompts (where a random ``k``-set's effect falls);
* ``p_value = (1 + #{random sets r: |effect_r| >= |top_effect|}) / (1 + n_random)``: the Monte
  Carlo permutation p-value of the top set against the random sets;
* ``normalized = top_effect / (clean - corrupt)`` of that quantity (noise: -1 = the behaviour
  fully broken; denoise: 1 = fully restored).

With ``checkpoint`` (a folder), each finished (phase, direction) run is saved there, named by
the hash of everything it depends on (model weights, tokens, metrics, head sets), and a rerun
reuses it: an interrupted validation loses at most the run in progress.
"""

from __future__ import annotations

import json
import math
import random
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric
from circuitkit.scoring.heads import top_heads
from circuitkit.tasks.base import Task, check_task, phase_task, task_phases

N_BUCKETS = 4  # prompt length buckets per engine run
VALIDATION_COLUMNS = ["phase", "direction", "quantity", "heads", "k", "n_random", "n_prompts",
                      "clean", "corrupt", "top_effect", "top_low", "top_high", "random_mean",
                      "random_low", "random_high", "p_value", "normalized"]


def _pad(rows: Sequence[Sequence[int]]) -> Int[Tensor, "n k"]:
    width = max(1, max((len(r) for r in rows), default=1))
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    return out


def restricted_mass_metric(positions: Sequence[Sequence[int]],
                           candidates: Sequence[Sequence[int]],
                           good: Sequence[Sequence[int]], name: str) -> PromptMetric:
    """Per prompt: mean over ``p`` in ``positions[i]`` of the softmax of ``logits[p - 1]``
    restricted to ``candidates[i]``, summed over ``good[i]`` (``evaluation.restricted_mass``
    as a ``PromptMetric`` with ``reads``; 0 for a prompt without positions, where
    ``restricted_mass`` gives NaN)."""
    pos, cand = _pad(positions), _pad(candidates)
    is_good = torch.stack([torch.isin(c, torch.as_tensor(list(g), dtype=torch.long))
                           for c, g in zip(cand, good, strict=True)]) & (cand >= 0)
    first = torch.where(pos[:, :1] >= 1, pos[:, :1] - 1, torch.zeros_like(pos[:, :1]))
    reads = torch.where(pos >= 1, pos - 1, first)

    def fn(logits: Tensor, idx: Tensor, rows: Tensor) -> Tensor:
        dev = logits.device
        p, c, g = pos[idx].to(dev), cand[idx].to(dev), is_good[idx].to(dev)
        valid = p >= 1
        b = torch.arange(logits.shape[0], device=dev)[:, None]
        step = logits[b, rows[b, (p - 1).clamp(min=0)]].float()  # [n, steps, vocab]
        cl = step.gather(-1, c.clamp(min=0)[:, None, :].expand(-1, step.shape[1], -1))
        cl = cl.masked_fill(~(c >= 0)[:, None, :], float("-inf"))
        mass = (cl.softmax(-1) * g[:, None, :]).sum(-1) * valid
        return mass.sum(-1) / valid.sum(-1).clamp(min=1)

    return PromptMetric(fn, name, reads=reads)


def focus_metric(task: Task) -> PromptMetric:
    """Reasoning Focus per prompt (``evaluation.focus_from_logits``) as a PromptMetric."""
    anchors = task.anchor_token_ids.tolist()
    ex = task.examples
    return restricted_mass_metric([e.anchor_pos for e in ex], [anchors] * len(ex),
                                  [task.anchor_token_ids[e.anchors].tolist() for e in ex],
                                  "focus")


def confusion_metric(task: Task) -> PromptMetric:
    """Near-Miss Confusion per prompt (``evaluation.confusion_from_logits``) as a PromptMetric."""
    lt = task.label_token_ids
    ex = task.examples
    return restricted_mass_metric([e.answer_pos for e in ex],
                                  [lt[e.targets + e.near_misses].tolist() for e in ex],
                                  [lt[e.near_misses].tolist() for e in ex], "confusion")


def random_head_sets(top: Sequence[tuple[int, int]], n_heads: int, n_random: int,
                     seed: int, n_layers: int | None = None) -> list[list[tuple[int, int]]]:
    """Up to ``n_random`` distinct head sets with the layer counts of ``top`` (module
    docstring), none equal to ``top``. Fewer distinct sets than ``n_random`` exist: all of them
    (the p-value is then exact over them; a warning says how many). ``top`` fills whole layers
    (no other set from them): the sets are drawn from all ``n_layers`` layers instead, with a
    warning, so the comparison keeps its size if not its depth."""
    counts: dict[int, int] = {}
    for layer, _ in top:
        counts[layer] = counts.get(layer, 0) + 1
    want = sorted(top)
    if all(c == n_heads for c in counts.values()):
        if n_layers is None or n_layers * n_heads == len(top):
            raise ValueError(f"the top heads fill whole layers {sorted(counts)}: no random set "
                             "from the same layers can differ from them; use a smaller k.")
        warnings.warn(f"the top heads fill whole layers {sorted(counts)}, so no random set from "
                      "the same layers differs from them: random sets are drawn from every "
                      "layer instead (same size, not the same depth).", stacklevel=3)
        pool = [(layer, h) for layer in range(n_layers) for h in range(n_heads)]
        return _distinct(lambda rng: sorted(rng.sample(pool, len(top))),
                         math.comb(len(pool), len(top)) - 1, want, n_random, seed)
    possible = math.prod(math.comb(n_heads, c) for c in counts.values()) - 1
    return _distinct(lambda rng: sorted((layer, h) for layer, c in sorted(counts.items())
                                        for h in rng.sample(range(n_heads), c)),
                     possible, want, n_random, seed)


def _distinct(draw: Any, possible: int, top: list[tuple[int, int]], n_random: int,
              seed: int) -> list[list[tuple[int, int]]]:
    """``min(n_random, possible)`` distinct draws, none equal to ``top`` (a repeated set would
    count twice in the p-value as if it were independent evidence)."""
    if possible < n_random:
        warnings.warn(f"only {possible} random head sets differ from the top set (n_random="
                      f"{n_random} asked): all {possible} are used, and the p-value's floor is "
                      f"1/{possible + 1}.", stacklevel=4)
    rng, seen, out = random.Random(seed), {tuple(top)}, []
    while len(out) < min(n_random, possible):
        s = draw(rng)
        if tuple(s) not in seen:
            seen.add(tuple(s))
            out.append(s)
    return out


def _bootstrap_weights(n: int, n_boot: int, seed: int) -> Float[Tensor, "n_boot n"]:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(n_boot, n, dtype=torch.float64)
    counts.scatter_add_(1, torch.randint(0, n, (n_boot, n), generator=g),
                        torch.ones(n_boot, n, dtype=torch.float64))
    return counts / n


def summarize(values: Float[Tensor, "n_sets n"], clean: Tensor, corrupt: Tensor,
              n_boot: int, seed: int) -> dict[str, float]:
    """Effect statistics of one quantity (module docstring). ``values[0]``: base run,
    ``values[1]``: top set, ``values[2:]``: random sets; ``clean``/``corrupt``: [n]."""
    d = (values[1:] - values[:1]).double()  # [1 + n_random, n]
    w = _bootstrap_weights(d.shape[1], n_boot, seed)
    boot = w @ d.T  # [n_boot, 1 + n_random]
    q = torch.tensor([0.025, 0.975], dtype=torch.float64)
    top_lo, top_hi = torch.quantile(boot[:, 0], q).tolist()
    r_lo, r_hi = torch.quantile(boot[:, 1:].reshape(-1), q).tolist()
    effects = d.mean(1)
    top = float(effects[0])
    p = (1 + int((effects[1:].abs() >= abs(top)).sum())) / len(effects)
    gap = float(clean.double().mean() - corrupt.double().mean())
    return dict(clean=float(clean.mean()), corrupt=float(corrupt.mean()), top_effect=top,
                top_low=top_lo, top_high=top_hi, random_mean=float(d[1:].mean()),
                random_low=r_lo, random_high=r_hi, p_value=p,
                normalized=top / gap if gap != 0 else float("nan"))


def validate_heads(model: Any, task: Task, scores: Any, k: int = 5, n_random: int = 20,
                   seed: int = 0, batch_size: int | None = None, n_boot: int = 2000,
                   progress: bool = True, checkpoint: str | Path | None = None):
    """Causal check of ``scores`` (``score_heads``' DataFrame) on ``task``: a pandas DataFrame
    with ``VALIDATION_COLUMNS``, one row per (phase, direction, quantity); see the module
    docstring. ``df.attrs["sets"]`` holds the top and random head sets used per phase.
    ``batch_size``: sequences per forward (default from free memory); ``checkpoint``: folder
    for finished runs (module docstring)."""
    import pandas as pd

    from circuitkit.patching.engine import ExactEngine
    from circuitkit.patching.sweep import Sweep

    f = hooks.facts(model)
    check_task(task, "validate_heads")
    if not 1 <= int(k) <= f.n_layers * f.n_heads:
        raise ValueError(f"k must be in 1..{f.n_layers * f.n_heads} (heads of the model); "
                         f"got {k!r}.")
    if int(n_random) < 1:
        raise ValueError(f"n_random must be >= 1; got {n_random!r}.")
    if len(scores) != f.n_layers * f.n_heads:
        raise ValueError(f"scores has {len(scores)} rows; the model has "
                         f"{f.n_layers * f.n_heads} heads (score_heads of this model?).")
    task.check_model(model)
    phases = task_phases(task)
    if not phases:
        raise ValueError(f"validate_heads: task {task.name!r} has no Phase-1 anchor steps and no "
                         "Phase-2 answer steps (anchor_pos / answer_pos >= 1): nothing to test.")
    saved = _Saved(model, checkpoint) if checkpoint is not None else None
    rows, sets_used = [], {}
    bar = _validation_bar(task, phases, int(n_random), progress)
    for phase in phases:  # a phase the task has no steps for is left out (induction: no anchors)
        tp = phase_task(task, phase)  # the examples with steps of this phase
        # prompts sorted by the positions their metric needs, run in length buckets: each
        # bucket's forwards stop after its own last read (the statistics ignore prompt order)
        need = tp.metric.reads.max(1).values
        tp = tp.subset(torch.argsort(need, stable=True).tolist())
        metric = tp.metric
        behaviour = focus_metric(tp) if phase == 1 else confusion_metric(tp)
        top = top_heads(scores, phase, k)
        rand = random_head_sets(top, f.n_heads, n_random, seed + phase, f.n_layers)
        sets = [[], top, *rand]
        sets_used[phase] = dict(top=top, random=rand)
        clean, corrupt = tp.clean_tokens, tp.corrupt_tokens
        n, seq = clean.shape
        if bar is not None:  # fewer distinct random sets than asked: the bar's total shrinks
            bar.total -= 2 * (2 + int(n_random) - len(sets)) * n
            bar.refresh()
        runs = {}
        for direction in ("noise", "denoise"):
            key = saved and saved.key(tp, phase, direction, sets, (metric, behaviour),
                                      f.d_vocab_out)
            if saved and (got := saved.load(key)) is not None:
                runs[direction] = got
                _say(bar, progress, f"validate: phase {phase} {direction}: reused")
                _counted(bar, len(sets) * n, got)
                continue
            _say(bar, progress, f"validate: phase {phase} {direction}, top-{k} {_fmt(top)} vs "
                                f"{len(rand)} random sets, {n} prompts")
            sweep = Sweep("heads", "z", direction, "all", f.n_layers, f.n_heads, 1, n, seq, True)
            # fast=False: run_head_sets takes the hooked path; no fast-path probe needed
            engine = ExactEngine(model, clean, corrupt, metric, sweep, fast=False,
                                 rows=batch_size)
            bounds = sorted({round(n * i / N_BUCKETS) for i in range(N_BUCKETS + 1)})
            runs[direction] = torch.cat([  # [2, n_sets, n]
                _counted(bar, len(sets) * (p1 - p0), engine.run_head_sets(
                    sets, p0, p1, metrics=[metric, behaviour], rows=batch_size))
                for p0, p1 in zip(bounds[:-1], bounds[1:], strict=True)], dim=2)
            if saved:
                saved.save(key, runs[direction])
        # base of noise = clean run; base of denoise = corrupt run
        for direction in ("noise", "denoise"):
            for qi, q in enumerate((metric, behaviour)):
                stats = summarize(runs[direction][qi], runs["noise"][qi, 0],
                                  runs["denoise"][qi, 0], n_boot, seed)
                rows.append(dict(phase=phase, direction=direction, quantity=q.name,
                                 heads=_fmt(top), k=int(k), n_random=len(rand),
                                 n_prompts=n, **stats))
    if bar is not None:
        bar.close()
    df = pd.DataFrame(rows, columns=VALIDATION_COLUMNS)
    df.attrs.update(seed=seed, n_boot=n_boot, sets={
        p: dict(top=[list(h) for h in d["top"]], random=[[list(h) for h in s] for s in d["random"]])
        for p, d in sets_used.items()})
    return df


def _validation_bar(task: Task, phases: list[int], n_random: int, progress: bool):
    """A bar over patched prompts: per phase and direction, (base + top + ``n_random``) sets x
    the phase's prompts (an upper bound when fewer distinct random sets exist; a reused run
    counts at once)."""
    if not progress:
        return None
    from tqdm.auto import tqdm

    total = sum(2 * (2 + n_random) * len(phase_task(task, p)) for p in phases)
    return tqdm(total=total, desc="validate", unit="patched-prompt", dynamic_ncols=True,
                file=sys.stderr)


def _say(bar: Any, progress: bool, line: str) -> None:
    """A progress line on stderr, above the bar when there is one."""
    if bar is not None:
        bar.write(line, file=sys.stderr)
    elif progress:
        print(line, file=sys.stderr)


def _counted(bar: Any, n: int, runs: Tensor) -> Tensor:
    if bar is not None:
        bar.update(n)
    return runs


class _Saved:
    """Finished (phase, direction) runs in a folder, one safetensors file each."""

    def __init__(self, model: Any, folder: str | Path):
        from circuitkit.files import check_writable_dir
        from circuitkit.patching.checkpoint import model_fingerprint

        self.folder = check_writable_dir(folder, "checkpoint")
        self.model = model_fingerprint(model)

    def key(self, task: Task, phase: int, direction: str, sets: list, metrics: Sequence[
            PromptMetric], d_vocab: int) -> str:
        from circuitkit.patching.checkpoint import identity_key, tokens_hash

        n, seq = task.clean_tokens.shape
        return identity_key(dict(
            format=1, model=self.model, tokens=tokens_hash(task.clean_tokens, task.corrupt_tokens),
            phase=phase, direction=direction, sets=[[list(h) for h in s] for s in sets],
            metrics=[m.fingerprint(n, seq, d_vocab) for m in metrics], buckets=N_BUCKETS))

    def path(self, key: str) -> Path:
        return self.folder / f"validation-{key}.safetensors"

    def load(self, key: str) -> Tensor | None:
        from safetensors.torch import load_file

        path = self.path(key)
        if not path.exists():
            return None
        try:
            return load_file(str(path))["runs"]
        except Exception:  # a torn or foreign file: run again (it is rewritten atomically)
            return None

    def save(self, key: str, runs: Tensor) -> None:
        from circuitkit.files import write_tensors

        write_tensors(self.path(key), {"runs": runs}, metadata={"key": json.dumps(key)})


def _fmt(heads: Sequence[tuple[int, int]]) -> str:
    return " ".join(f"L{layer}H{h}" for layer, h in heads)
