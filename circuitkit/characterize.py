"""``characterize``: the main job. Patch every head in both directions for both phases, score
every head, validate the top heads causally, and write one results folder. A task with steps
of one phase only (a JSONL without ``anchor_pos``, or without ``answer_pos``) is characterized
in that phase: its sweeps, scores and validation rows are that phase's.

``out_dir`` after a run::

    patch-p1-denoise.safetensors/.json   PatchResult (ck.PatchResult.load), phase-1 task metric
    patch-p1-noise.*  patch-p2-denoise.*  patch-p2-noise.*
    scores.csv        score_heads (one row per head)
    validation.csv    validate_heads (top-k vs random head sets, per phase and direction)
    summary.json      identity (model, task fingerprints, options), versions, ``phases``,
                      per-step timings, top heads per phase, the list of files, ``complete``
    checkpoints/      exact-patching chunk checkpoints (a killed sweep resumes mid-way) and
                      validation's finished (phase, direction) runs
    report.html       one self-contained page (circuitkit report DIR rewrites it)

Resumable: every finished step is recorded in ``summary.json`` (written atomically after the
step's files), and rerunning the same call reuses those steps (within validation, its finished
runs); a folder holding a run with a different identity is refused. A pretrained LLM whose
vocabulary cannot hold the task's word tokens gets the task rendered as text
(``circuitkit.scoring.text.text_task``; ``text=None`` decides automatically).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_N = 128  # icd-teacher on icd10: ~2 min on 2 busy CPU cores (measured; see the report)


def patch_steps(phases: tuple[int, ...] | list[int] = (1, 2)) -> list[tuple[int, str]]:
    """The (phase, direction) sweeps of a task with steps for ``phases``."""
    return [(phase, direction) for phase in phases for direction in ("denoise", "noise")]


def step_names(phases: tuple[int, ...] | list[int] = (1, 2)) -> list[str]:
    """The step names ``characterize`` records in ``summary.json``, in order."""
    return [f"patch-p{p}-{d}" for p, d in patch_steps(phases)] + ["scores", "validation"]


PATCH_STEPS = patch_steps()  # a task with both phases (icd10, synthetic)
STEPS = step_names()


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def characterize(model_name_or_model: Any, task_name: str = "icd10",
                 out_dir: str | Path = "characterize-out", n_examples: int = DEFAULT_N,
                 seed: int = 0, split: str = "test", k: int = 5, n_random: int = 20,
                 batch_size: int | None = None, patch_method: str = "exact",
                 text: bool | None = None, progress: bool = True,
                 task_kwargs: dict[str, Any] | None = None, report: bool = True
                 ) -> dict[str, Any]:
    """Run (or resume) the whole characterization into ``out_dir`` (module docstring); returns the
    summary dict also written to ``out_dir/summary.json``.

    ``n_examples``: prompts (for a text-rendered task: kept text examples); ``k``/``n_random``:
    validation set size and number of random sets; ``patch_method``: "exact" (default),
    "attribution" or "attribution+exact" (for models too big for exact sweeps on the machine);
    ``task_kwargs``: passed to ``ck.load_task`` (e.g. ``n_labels``); ``report``: write
    ``out_dir/report.html`` at the end (``circuitkit.viz.report``).
    """
    import circuitkit as ck
    from circuitkit import files
    from circuitkit.patching.api import versions
    from circuitkit.patching.checkpoint import identity_diff, model_fingerprint
    from circuitkit.patching.results import quiet_baseline
    from circuitkit.scoring.heads import score_heads, top_heads
    from circuitkit.scoring.text import load_for
    from circuitkit.scoring.validate import validate_heads
    from circuitkit.tasks.base import phase_task, task_phases

    if int(n_examples) < 1:
        raise ValueError(f"n_examples must be >= 1; got {n_examples!r}.")
    if int(k) < 1:  # checked again against the model's heads below, before any step runs
        raise ValueError(f"k must be a positive number of heads; got {k!r}.")
    if int(n_random) < 1:
        raise ValueError(f"n_random must be >= 1; got {n_random!r}.")
    out = files.check_writable_dir(out_dir, "out_dir")
    t_all = time.perf_counter()
    model = ck.load_model(model_name_or_model) if isinstance(model_name_or_model, str | Path) \
        else model_name_or_model
    name = str(model_name_or_model) if isinstance(model_name_or_model, str | Path) \
        else str(getattr(model.cfg, "model_name", type(model).__name__))
    task_kwargs = dict(task_kwargs or {})
    task, rendered = load_for(model, task_name, int(n_examples), seed, split, text, **task_kwargs)
    task.check_model(model)
    n_heads = model.cfg.n_layers * model.cfg.n_heads
    if int(k) > n_heads:
        raise ValueError(f"k must be in 1..{n_heads} (heads of the model); got {k!r}.")
    phases = task_phases(task)  # a task with one phase's steps is characterized in that phase
    if not phases:
        raise ValueError(
            f"characterize needs a task with Phase-1 anchor steps or Phase-2 answer steps "
            f"(anchor_pos / answer_pos >= 1: icd10, synthetic, or a JSONL with them); "
            f"{task_name!r} has neither: no position for a metric to read.")
    per_phase = {p: phase_task(task, p) for p in phases}  # examples with that phase's steps
    fingerprint = {p: per_phase[p].fingerprint() if p in phases else None for p in (1, 2)}
    # what the sweeps and scores depend on; k and n_random change validation only
    # the model by its weights (model_fingerprint), not by the path it was typed as
    identity = dict(model_fingerprint=model_fingerprint(model), task=task_name,
                    task_fingerprint_p1=fingerprint[1],
                    task_fingerprint_p2=fingerprint[2], text=rendered,
                    n_examples=len(task), seed=seed, split=split, patch_method=patch_method,
                    task_kwargs=json.loads(json.dumps(task_kwargs, default=str)))
    validation_options = dict(k=int(k), n_random=int(n_random))
    summary_path = out / "summary.json"
    summary: dict[str, Any] = {}
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        old = dict(summary.get("identity", {}))
        old.pop("model", None)  # older folders named the model in the identity
        stored_options = summary.get("validation_options") or {
            key: old.pop(key) for key in ("k", "n_random") if key in old}  # older folders
        if old != identity:
            raise ValueError(f"out_dir {out} holds a characterize run with a different identity "
                             f"(stored, now): {identity_diff(old, identity)}; use a new folder "
                             "or delete it.")
        if stored_options != validation_options:  # same sweeps and scores: validate again
            summary.get("steps", {}).pop("validation", None)
    expected = step_names(phases)  # a report of a partial run says which are missing
    local = Path(name).expanduser()
    summary.update(model=name, model_path=str(local.resolve()) if local.is_dir() else None)
    summary.update(identity=identity, versions=versions(), task_config=task.config,
                   phases=phases, steps_expected=expected, complete=False,
                   validation_options=validation_options)
    steps: dict[str, Any] = summary.setdefault("steps", {})

    def record(step: str, seconds: float, files_: list[str]) -> None:
        steps[step] = dict(seconds=round(seconds, 3), files=files_)
        files.write_json(summary_path, summary)

    sweeps = patch_steps(phases)
    total = len(sweeps) + 2
    sweep_results: dict[tuple[int, str], Any] = {}
    _log(progress, f"characterize {name} on {task.name} ({len(task)} examples"
                   f"{', text-rendered' if rendered else ''}) -> {out}")
    for i, (phase, direction) in enumerate(sweeps, 1):
        step = f"patch-p{phase}-{direction}"
        if step in steps:
            _log(progress, f"[{i}/{total}] {step}: reused")
            sweep_results[phase, direction] = _stored(out / step)
            continue
        _log(progress, f"[{i}/{total}] {step}")
        t0 = time.perf_counter()
        tp = per_phase[phase]
        ckpt = out / "checkpoints" / step if patch_method == "exact" else None
        with quiet_baseline():  # said once per phase below
            res = ck.patch_heads(model, tp.clean_tokens, tp.corrupt_tokens, tp.metric,
                                 direction=direction, method=patch_method,
                                 batch_size=batch_size, checkpoint=ckpt, progress=progress,
                                 task_hash=tp.fingerprint())
        res.meta.update(model_name=name, task=task_name, phase=phase, n_examples=len(tp))
        res.save(out / step)
        sweep_results[phase, direction] = res
        record(step, time.perf_counter() - t0, [f"{step}.safetensors", f"{step}.json"])
    _say_degenerate(sweep_results)
    import pandas as pd

    i = len(sweeps) + 1
    if "scores" in steps and (out / "scores.csv").exists():
        _log(progress, f"[{i}/{total}] scores: reused")
        scores = pd.read_csv(out / "scores.csv")
    else:
        _log(progress, f"[{i}/{total}] scores")
        t0 = time.perf_counter()
        scores = score_heads(model, task, batch_size=batch_size, progress=progress)
        files.write_text(out / "scores.csv", scores.to_csv(index=False))
        summary["scores_attrs"] = {k_: v for k_, v in scores.attrs.items()}
        record("scores", time.perf_counter() - t0, ["scores.csv"])
    summary["top_heads"] = {f"phase{p}": [list(h) for h in top_heads(scores, p, k)]
                            for p in phases}  # (this call's k)
    i += 1
    if "validation" in steps and (out / "validation.csv").exists():
        _log(progress, f"[{i}/{total}] validation: reused")
    else:
        _log(progress, f"[{i}/{total}] validation")
        t0 = time.perf_counter()
        val = validate_heads(model, task, scores, k=k, n_random=n_random, seed=seed,
                             batch_size=batch_size, progress=progress,
                             checkpoint=out / "checkpoints" / "validation")
        files.write_text(out / "validation.csv", val.to_csv(index=False))
        summary["validation_sets"] = val.attrs.get("sets")
        record("validation", time.perf_counter() - t0, ["validation.csv"])
    summary["complete"] = all(step in steps for step in expected)
    summary["seconds_this_call"] = round(time.perf_counter() - t_all, 3)
    summary["seconds_all_steps"] = round(sum(s["seconds"] for s in steps.values()), 3)
    files.write_json(summary_path, summary)
    if report:  # always rewritten: it is a view of the folder, cheap next to the steps
        from circuitkit.viz.report import describe_written, write_report

        _log(progress, "report")
        t0 = time.perf_counter()
        path = write_report(out, model=model, task=task)
        _log(progress, describe_written(path, time.perf_counter() - t0))
    _log(progress, f"done: {out} (steps {summary['seconds_all_steps']:.1f} s, this call "
                   f"{time.perf_counter() - t_all:.1f} s)")
    return summary


def _stored(path: Path) -> Any:
    """A reused sweep's result (None if it cannot be read: the report says what is missing)."""
    from circuitkit.patching.results import PatchResult

    try:
        return PatchResult.load(path)
    except ValueError:
        return None


def _say_degenerate(results: dict[tuple[int, str], Any]) -> None:
    """One warning per phase whose corruption does not lower its metric by the margin
    (``PatchResult.degenerate``, the rule every entry point follows), naming its sweeps."""
    import warnings

    from circuitkit.patching.results import DegenerateBaselineWarning

    for phase in sorted({p for p, _ in results}):
        bad = {d: r for (p, d), r in results.items() if p == phase and r is not None
               and r.degenerate}
        if bad:
            reason = next(iter(bad.values())).degenerate_reason().removeprefix("circuitkit: ")
            names = ", ".join(f"patch-p{phase}-{d}" for d in bad)
            warnings.warn(DegenerateBaselineWarning(
                f"circuitkit: phase {phase} ({names}): {reason}"), stacklevel=3)
