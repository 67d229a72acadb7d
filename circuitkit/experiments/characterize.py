"""``characterize``: the main job. Patch every head in both directions for both phases, score
every head, validate the top heads causally, and write one results folder. A task with steps
of one phase only (a JSONL without ``anchor_pos``, or without ``answer_pos``) is characterized
in that phase only.

``out_dir`` after a run::

    patch-p{1,2}-{denoise,noise}.*  PatchResult (ck.PatchResult.load), the phase's task metric
    scores.csv        score_heads (bootstrap rank intervals, top-k inclusion)
    validation.csv    validate_heads (the score top-k vs layer-matched and all-layer sets)
    validation-causal.csv  (``stages``) the causal top-k against all-layers and
                      layer-stratified sets (``validate_selections``)
    groups/, causal.csv  (``stages``, exact only) ``_stages_step``'s [layer, head, group]
                      sweeps (``heldout-*``: the held-out notes) and the causal columns
    bins/             (``stages``) the paper's cumulative bins (``_bins_step``)
    head-ablation.csv ablate_heads (zero / mean / resample; resample needs two prompts with
                      steps of every phase, else it is skipped: ``summary["skipped"]``)
    edges/            (``edges=True``) ``_edges_step``'s edges.*, paths.*, circuit.json
    summary.json      identity, versions, ``phases``, timings, files and SHA-256, top heads,
                      ``complete``, score summaries (docs/scores.md), ``lead`` and ``claims``
                      (``lead_picture``), ``ablations``, ``skipped`` and the resume record
    checkpoints/      exact-patching chunks and validation's finished runs
    report.html       one self-contained page (circuitkit report DIR rewrites it)

The job is a list of named steps (``_steps``) run by ``experiments.runner.run_steps``: a rerun
reuses every step whose inputs and files are unchanged (``runner.StepRecord``); a folder holding
a run with a different identity is refused, and ``out_dir`` is locked for the whole run
(``files.lock_folder``). A pretrained LLM whose vocabulary cannot hold the task's word tokens
gets the task rendered as text (``scoring.text.text_task``; ``text=None`` decides).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from circuitkit.experiments.runner import (
    RECORD_VERSION,
    VERSION_KEY,
    Step,
    StepRecord,
    depends_hash,
    options_of,
    read_steps,
    run_steps,
)

# icd-teacher on icd10: ~63 s on 1 CPU thread (benchmarks/characterize.py); --stages adds
# 4 sweeps x 5 position groups (~37 s on 2 busy cores)
DEFAULT_N = 128
# Random head sets the top set is validated against: a p-value floor of 1/201, so p < 0.05 can
# be shown with its Monte Carlo interval below 0.05 (20 sets, floor 0.048, could not: the same
# top set read 0.048-0.143 over disjoint batches). 1000 (``validate_heads``' default, the
# science runs') costs ~5x more: ~0.8 s per set on the teacher's 128 notes on one CPU thread.
N_RANDOM = 200  # at most: a pool stops at 50 or 100 once its p-values are settled at 0.05
# by their Monte Carlo intervals (validate_selections(sequential=True))
# ... and ablated against (``ablate_heads``' default): three ablations, each decoding outputs.
N_RANDOM_ABLATION = 20
# the pools the score-selected top set is validated against: layer-matched ("any k heads of the
# same layers", the headline p) and all-layer sets beside it
SCORE_POOLS = ("layer-stratified", "all-layers")


def patch_steps(phases: tuple[int, ...] | list[int] = (1, 2)) -> list[tuple[int, str]]:
    """The (phase, direction) sweeps of a task with steps for ``phases``."""
    return [(phase, direction) for phase in phases for direction in ("denoise", "noise")]


def step_names(phases: tuple[int, ...] | list[int] = (1, 2), stages: bool = False) -> list[str]:
    """The step names ``characterize`` records in ``summary.json``, in order (``stages``: the
    position-group sweeps, ``--stages``: run with exact patching)."""
    return [f"patch-p{p}-{d}" for p, d in patch_steps(phases)] + (
        ["stages"] if stages else []) + ["scores", "validation"] + (
        ["bins"] if stages else []) + ["ablation"]


STEPS = step_names()  # a task with both phases (icd10, synthetic)


def _log(progress: bool, msg: str) -> None:
    if progress:  # (a task's name from a file: escaped for the terminal)
        from circuitkit.escape import terminal_safe

        print(terminal_safe(msg), file=sys.stderr, flush=True)


@dataclass(frozen=True)
class CharacterizeOptions:
    """``characterize``'s options (a dict of these fields is accepted too).

    ``n_examples``: prompts (for a text-rendered task: kept text examples); ``seed``,
    ``split``: which examples (``ck.load_task``); ``k``: top set size (bootstrap inclusion,
    validation, ablation); ``n_random`` / ``n_random_ablation``: random head sets per pool the
    top set is validated / ablated against (``N_RANDOM``: why 200); ``batch_size``: sequences
    per forward pass (None: automatic); ``patch_method``: "exact" (default), "attribution" or
    "attribution+exact" (for models too big for exact sweeps on the machine); ``text``:
    render the task as text (None: when the model's vocabulary cannot hold its word tokens);
    ``progress``: bars and one line per step on stderr; ``task_kwargs``: passed to
    ``ck.load_task`` (e.g. ``n_labels``); ``report``: write ``out_dir/report.html`` at the end;
    ``edges``: also patch the edges from the top ``k`` Phase-1 heads into the top ``k`` Phase-2
    heads (``_edges_step``); ``stages`` (default on; exact patching only): the stage sweeps, causal
    columns, cumulative bins and lead (module docstring); ``select_n``: held-out selection: scores
    (and causal columns) on the first ``select_n`` examples, validation and ablation on the
    others (``summary["samples"]``); "half" (the default): the first half of the examples;
    None: the same examples for both (a p-value then tests heads chosen on the very notes it
    is computed on)."""

    n_examples: int = DEFAULT_N
    seed: int = 0
    split: str = "test"
    k: int = 5
    n_random: int = N_RANDOM
    batch_size: int | None = None
    patch_method: str = "exact"
    text: bool | None = None
    progress: bool = True
    task_kwargs: dict[str, Any] | None = None
    report: bool = True
    edges: bool = False
    stages: bool = True
    select_n: int | str | None = "half"
    n_random_ablation: int = N_RANDOM_ABLATION


def characterize(model_name_or_model: Any, task_name: str = "icd10",
                 out_dir: str | Path = "characterize-out",
                 options: CharacterizeOptions | dict[str, Any] | None = None,
                 **overrides: Any) -> dict[str, Any]:
    """Run (or resume) the whole characterization into ``out_dir`` (module docstring); returns the
    summary dict also written to ``out_dir/summary.json``. ``options``: ``CharacterizeOptions``
    (or a dict of its fields); ``overrides``: its fields, on top
    (``characterize(model, "icd10", out, n_examples=64)``). The job is ``_steps``' list, run by
    ``experiments.runner.run_steps`` and resumed from the record in ``summary.json``."""
    opts = options_of(CharacterizeOptions, options, overrides, "characterize")
    _check_options(opts)
    with contextlib.ExitStack() as held:  # the folder's lock, released however the run ends
        job = _open(model_name_or_model, task_name, out_dir, opts, held)
        record = _resume(job)
        _log(opts.progress, f"characterize {job.name} on {job.task.name} ({len(job.task)} "
                            f"{opts.split} examples, seed {opts.seed}"
                            f"{', text-rendered' if job.rendered else ''}) -> {job.out}")
        for said in job.skipped:
            _log(opts.progress, f"note: {said}")
        run_steps(_steps(job), record, lambda msg: _log(opts.progress, msg))
        return _finish(job, record)


def head_ablations(task: Any) -> tuple[tuple[str, ...], list[str]]:
    """The ablations ``characterize``'s ablation step runs on ``task``, and one line per one it
    skips: "resample" takes each head's ``z`` from another prompt, so it needs two or more
    prompts with steps of every phase (``experiments.validation.ablation_task``; a task with none is
    refused here, before any step runs)."""
    from circuitkit.experiments.validation import ABLATIONS, ablation_task

    n = len(ablation_task(task))
    if n >= 2:
        return ABLATIONS, []
    return tuple(a for a in ABLATIONS if a != "resample"), [
        f"resample ablation skipped: it takes each head's z from another prompt, and the task "
        f"has {n} prompt with steps of every phase (zero and mean ablation run; -n / n_examples "
        "of 2 or more runs resample too)."]


@dataclass
class _Job:
    """One characterize call: its options, folder, model, task and samples (``_open``), and
    what its steps hand on: the summary, the sweeps' results, the scores."""

    opts: CharacterizeOptions
    out: Path
    model: Any
    name: str  # the model as the summary names it
    task_name: str
    task: Any
    rendered: bool
    phases: list[int]
    per_phase: dict[int, Any]  # each phase's task: the examples with that phase's steps
    chosen: Any  # the selection notes (scores, causal columns)
    held_out: Any  # the validation notes (validation, bins, ablation)
    samples: dict[str, Any]
    ablations: tuple[str, ...]
    skipped: list[str]
    stages: bool  # the stage sweeps run (asked for, and exact patching)
    identity: dict[str, Any] = field(default_factory=dict)
    per_phase_chosen: dict[int, Any] = field(default_factory=dict)
    edited: dict[int, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    sweeps: dict[tuple[int, str], Any] = field(default_factory=dict)
    scores: Any = None
    t_all: float = 0.0

    @property
    def meta(self) -> dict[str, Any]:
        return dict(model_name=self.name, task=self.task_name)


def _check_options(opts: CharacterizeOptions) -> None:
    if int(opts.n_examples) < 1:
        raise ValueError(f"n_examples must be >= 1; got {opts.n_examples!r}.")
    if int(opts.k) < 1:  # checked again against the model's heads in _open, before any step
        raise ValueError(f"k must be a positive number of heads; got {opts.k!r}.")
    for what, v in (("n_random", opts.n_random), ("n_random_ablation", opts.n_random_ablation)):
        if int(v) < 1:
            raise ValueError(f"{what} must be >= 1; got {v!r}.")


def _open(model_name_or_model: Any, task_name: str, out_dir: str | Path,
          opts: CharacterizeOptions, held: contextlib.ExitStack) -> _Job:
    """The folder (locked for the run), the model, the task, its phases and samples, and what
    the run skips (each said in one line), all before any step runs."""
    import circuitkit as ck
    from circuitkit import files
    from circuitkit.experiments.claims import note_edited
    from circuitkit.scoring.text import load_for
    from circuitkit.tasks.base import phase_task, task_phases

    out = files.check_writable_dir(out_dir, "out_dir")
    if not files.holds_lock(out):  # (the CLI's claim holds it already)
        held.enter_context(files.lock_folder(out, "out_dir"))  # one run per folder
    t_all = time.perf_counter()
    named = isinstance(model_name_or_model, str | Path)
    model = ck.load_model(model_name_or_model) if named else model_name_or_model
    name = str(model_name_or_model) if named \
        else str(getattr(model.cfg, "model_name", type(model).__name__))
    task_kwargs = dict(opts.task_kwargs or {})
    task, rendered = load_for(model, task_name, int(opts.n_examples), opts.seed, opts.split,
                              opts.text, **task_kwargs)
    task.check_model(model)
    n_heads = model.cfg.n_layers * model.cfg.n_heads
    if int(opts.k) > n_heads:
        raise ValueError(f"k must be in 1..{n_heads} (heads of the model); got {opts.k!r}.")
    select_n, no_split = _select_n(opts.select_n, len(task))
    chosen, held_out, samples = selection_samples(task, select_n, opts.seed)
    phases = task_phases(task)  # a task with one phase's steps is characterized in that phase
    if not phases:
        raise ValueError(
            f"characterize needs a task with Phase-1 anchor steps or Phase-2 answer steps "
            f"(anchor_pos / answer_pos >= 1: icd10, synthetic, or a JSONL with them); "
            f"{task_name!r} has neither: no position for a metric to read.")
    ablations, skipped = head_ablations(task)  # decided before any step runs
    stages, said = _stages_said(opts)
    job = _Job(opts=opts, out=out, model=model, name=name, task_name=task_name, task=task,
               rendered=rendered, phases=phases,
               per_phase={p: phase_task(task, p) for p in phases}, chosen=chosen,
               held_out=held_out, samples=samples, ablations=ablations,
               skipped=[*skipped, *no_split, *said], stages=stages, t_all=t_all)
    # the selection notes' phase tasks, for the steps that select on them (stages, edges)
    if opts.stages or opts.edges:
        job.per_phase_chosen = {p: phase_task(chosen, p) for p in phases}
    job.edited = {p: note_edited(job.per_phase[p]) for p in phases}
    job.identity = _identity(job, select_n, task_kwargs)
    return job


def _stages_said(opts: CharacterizeOptions) -> tuple[bool, list[str]]:
    """Whether the stage sweeps run, and the line saying why not (exact sweeps only; position
    groups cost about five sweeps' time)."""
    if opts.stages and opts.patch_method != "exact":
        return False, [f"stages (the [layer, head, group] sweeps over the task's position "
                       f"groups) skipped: they run with patch_method='exact'; got "
                       f"{opts.patch_method!r}."]
    if not opts.stages:
        return False, ["stages skipped (--no-stages): where each decision is made, the stable "
                       "heads that carry it, the paper's cumulative bins and the claims table "
                       "need the stage sweeps; the findings below tell the descriptive scores' "
                       "story only."]
    return True, []


def _identity(job: _Job, select_n: int | None, task_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What the sweeps and scores depend on (``k`` and ``n_random`` change the scores' top-k
    inclusion, validation and ablation only: ``step_depends``); the model by its weights
    (``model_fingerprint``), not by the path it was typed as."""
    from circuitkit.identity import model_fingerprint

    fingerprint = {p: job.per_phase[p].fingerprint() if p in job.phases else None
                   for p in (1, 2)}
    o = job.opts
    return dict(model_fingerprint=model_fingerprint(job.model), task=job.task_name,
                task_fingerprint_p1=fingerprint[1], task_fingerprint_p2=fingerprint[2],
                text=job.rendered, n_examples=len(job.task), seed=o.seed, split=o.split,
                patch_method=o.patch_method,
                select_n=None if select_n is None else int(select_n),
                task_kwargs=json.loads(json.dumps(task_kwargs, default=str)))


def step_depends(identity: dict[str, Any], options: dict[str, Any]) -> dict[str, str]:
    """Each step's ``depends`` (``runner.depends_hash``): the sweeps, stages and bins depend on
    the run's identity; scores, validation and edges on it and ``k``, ``n_random``; the
    ablation on those and ``n_random_ablation`` (a new ablation count alone redoes the ablation
    only). ``options``: ``summary["validation_options"]``."""
    sweeps = depends_hash(dict(identity=identity))
    chosen = depends_hash(dict(identity=identity, k=options.get("k"),
                               n_random=options.get("n_random")))
    ablation = depends_hash(dict(identity=identity, k=options.get("k"),
                                 n_random=options.get("n_random"),
                                 n_random_ablation=options.get("n_random_ablation")))
    out = {f"patch-p{p}-{d}": sweeps for p, d in patch_steps((1, 2))}
    out.update(stages=sweeps, bins=sweeps, scores=chosen, validation=chosen, edges=chosen,
               ablation=ablation)
    return out


RESUME_REMEDY = "delete it to start the run over (finished sweep chunks in checkpoints/ are reused)"


def _resume(job: _Job) -> StepRecord:
    """The run's summary and resume record: ``summary.json``'s when there is one (a folder
    holding a run of another identity is refused; a step whose inputs changed is dropped, to
    run again), with this call's identity, options and plan."""
    from circuitkit import files
    from circuitkit.identity import IdentityMismatch, identity_diff
    from circuitkit.patching.api import versions

    o, out = job.opts, job.out
    summary_path = out / "summary.json"
    options = dict(k=int(o.k), n_random=int(o.n_random),
                   n_random_ablation=int(o.n_random_ablation))
    summary: dict[str, Any] = {}
    if summary_path.exists():
        try:
            summary = json.loads(summary_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{summary_path}: not valid JSON (truncated?) at line {e.lineno} "
                             f"column {e.colno}; {RESUME_REMEDY}.") from None
        old, stored = _stored_identity(summary if isinstance(summary, dict) else {})
        read_steps(summary, summary_path, RESUME_REMEDY,
                   lambda name: step_depends(job.identity, stored).get(name))
        if old != job.identity:
            diff = identity_diff(old, job.identity)
            raise IdentityMismatch(f"out_dir {out} holds a characterize run with a different "
                                   f"identity (stored, now): {diff}; use a new folder or "
                                   "delete it.", diff)
    expected = step_names(job.phases, job.stages) + (["edges"] if o.edges else [])
    local = Path(job.name).expanduser()
    summary.update(model=job.name, model_path=str(local.resolve()) if local.is_dir() else None)
    summary.update(identity=job.identity, versions=versions(), task_config=job.task.config,
                   phases=job.phases, steps_expected=expected, complete=False,
                   validation_options=options, ablations=list(job.ablations),
                   skipped=job.skipped, samples=job.samples, corruption={
                       f"phase{p}": dict(name=job.task.config.get("corruption"),
                                         note_edited=job.edited[p]) for p in job.phases})
    summary[VERSION_KEY] = RECORD_VERSION
    job.summary = summary
    record = StepRecord(out, summary.setdefault("steps", {}),
                        lambda: files.write_json(summary_path, summary), "characterize",
                        summary_path)
    record.forget_stale(step_depends(job.identity, options))
    summary["steps_run_this_call"] = record.ran  # the steps computed by this call
    return record


def _stored_identity(summary: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A stored summary's identity and validation options, as older versions stored them
    too: the model named in the identity (dropped), ``k`` and ``n_random`` in it, and no
    ``n_random_ablation`` (the ablation drew ``n_random`` sets then)."""
    old = dict(summary.get("identity", {}))
    old.pop("model", None)
    stored = dict(summary.get("validation_options") or {
        key: old.pop(key) for key in ("k", "n_random") if key in old})
    stored.setdefault("n_random_ablation", stored.get("n_random"))
    return old, stored


def _lists(name: str) -> Any:
    """A recorded step is current only when it lists ``name`` (a version whose step did less
    did not write it; its finished parts still resume from their checkpoints)."""
    return lambda entry: name in entry.get("files", [])


def _steps(job: _Job) -> list[Step]:
    """The job, in order: the head sweeps (each phase, both directions), the stage sweeps
    (``stages``), scores, validation, bins (``stages``), ablation and edges (``edges``), each
    bound to what it depends on (``step_depends``); between them, unrecorded views."""
    from circuitkit.scoring.causal import has_causal_columns

    dep = step_depends(job.identity, job.summary["validation_options"])
    steps = [Step(f"patch-p{p}-{d}", partial(_patch_step, job, p, d), dep[f"patch-p{p}-{d}"],
                  reuse=partial(_reuse_sweep, job, p, d)) for p, d in patch_steps(job.phases)]
    steps.append(Step("sweeps-said", partial(_sweeps_said, job)))
    if job.stages:  # (a record from before the held-out stage sweeps: run again)
        steps.append(Step("stages", partial(_stages, job), dep["stages"], current=_lists(
            f"groups/heldout-patch-p{job.phases[-1]}-noise.json")
            if job.samples["held_out"] else None))
    steps += [Step("scores", partial(_scores, job), dep["scores"],
                   reuse=partial(_read_scores, job)),
              Step("top-heads", partial(_top_heads, job)),
              # (a record from before the causal sets were validated: run again)
              Step("validation", partial(_validation, job), dep["validation"],
                   current=lambda e: not has_causal_columns(job.scores)
                   or _lists("validation-causal.csv")(e))]
    if job.stages:
        steps.append(Step("bins", partial(_bins, job), dep["bins"]))
    steps.append(Step("ablation", partial(_ablation, job), dep["ablation"]))
    if job.opts.edges:  # (before the edges step patched paths: run again)
        steps.append(Step("edges", partial(_edges, job), dep["edges"],
                          current=_lists("edges/paths.json")))
    return steps


def _patch_step(job: _Job, phase: int, direction: str, at: str) -> list[str]:
    """Every head patched (``ck.patch_heads``) on the phase's task, both samples, one
    direction: ``out/patch-p{phase}-{direction}.*``."""
    import circuitkit as ck
    from circuitkit.patching.results import quiet_baseline

    o, step, tp = job.opts, f"patch-p{phase}-{direction}", job.per_phase[phase]
    how = "clean into corrupt" if direction == "denoise" else "corrupt into clean"
    _log(o.progress, f"{at} {step}: Phase {phase}, metric {tp.metric.name}, {direction} "
                     f"({how} runs), {len(tp)} prompts"
                     + (" (both samples)" if job.samples["held_out"] else ""))
    ckpt = job.out / "checkpoints" / step if o.patch_method == "exact" else None
    with quiet_baseline():  # said once per phase (_sweeps_said)
        res = ck.patch_heads(job.model, tp.clean_tokens, tp.corrupt_tokens, tp.metric,
                             direction=direction, method=o.patch_method,
                             options=dict(batch_size=o.batch_size, checkpoint=ckpt,
                                          progress=o.progress, task_hash=tp.fingerprint()))
    res.meta.update(model_name=job.name, task=job.task_name, phase=phase, n_examples=len(tp))
    written = res.save(job.out / step)
    job.sweeps[phase, direction] = res
    return [p.name for p in written]


def _reuse_sweep(job: _Job, phase: int, direction: str) -> None:
    job.sweeps[phase, direction] = _stored(job.out / f"patch-p{phase}-{direction}")


def _sweeps_said(job: _Job, at: str) -> list[str]:
    """The sweep pages' one plotly.min.js (not a step's file: rewritten whenever incomplete)
    and one warning per phase whose corruption does not lower its metric."""
    from circuitkit.patching.results import plotly_bundle

    plotly_bundle(job.out)
    _say_degenerate(job.sweeps)
    return []


def _stages(job: _Job, at: str) -> list[str]:
    from circuitkit.tasks.base import phase_task, task_phases

    _log(job.opts.progress, f"{at} stages: every head patched at each position group "
                            f"(evidence, anchor, shortlist, answer steps, all) per phase, both "
                            f"directions, on the {len(job.chosen)} selection examples")
    held_tasks = {p: phase_task(job.held_out, p) for p in task_phases(job.held_out)
                  if p in job.phases} if job.samples["held_out"] else None
    return _stages_step(job.model, job.per_phase_chosen, job.out, job.opts.k,
                        job.opts.batch_size, job.opts.progress, job.meta, job.summary,
                        held_tasks)


def _scores(job: _Job, at: str) -> list[str]:
    """Every head's scores on the selection notes (``score_heads``), the stage sweeps' causal
    columns beside them: ``out/scores.csv``."""
    import pandas as pd

    from circuitkit import files
    from circuitkit.scoring.heads import score_heads

    o, out = job.opts, job.out
    _log(o.progress, f"{at} scores: every head's Phase-{'/'.join(map(str, job.phases))} "
                     f"scores on {_on(job.samples, 'select')}")
    scores = score_heads(job.model, job.chosen, batch_size=o.batch_size, progress=o.progress,
                         k=o.k, seed=o.seed)
    if job.stages and (out / "causal.csv").is_file():  # the causal columns beside the scores
        causal = pd.read_csv(out / "causal.csv").drop(columns=["name"], errors="ignore")
        attrs = dict(scores.attrs)  # (a merge drops them: scores_attrs would be empty)
        scores = scores.merge(causal, on=["layer", "head"], how="left")
        scores.attrs.update(attrs)
    files.write_text(out / "scores.csv", scores.to_csv(index=False))
    job.summary["scores_attrs"] = _json_safe(scores.attrs)
    job.scores = scores
    return ["scores.csv"]


def _read_scores(job: _Job) -> None:
    import pandas as pd

    job.scores = pd.read_csv(job.out / "scores.csv")


def _top_heads(job: _Job, at: str) -> list[str]:
    """The summary's top heads and their stability, for this call's ``k``."""
    from circuitkit.scoring.heads import top_heads

    k = job.opts.k
    job.summary["top_heads"] = {f"phase{p}": [list(h) for h in top_heads(job.scores, p, k)]
                                for p in job.phases}
    job.summary["stability"] = _json_safe(stability(job.scores, job.phases, k))
    return []


def _validation(job: _Job, at: str) -> list[str]:
    """The top ``k`` heads of each phase patched together on the held-out notes against
    random sets (the causal top sets too, with the stage sweeps): ``validation.csv``,
    ``validation-causal.csv``; finished runs kept in ``checkpoints/validation``."""
    from circuitkit import files
    from circuitkit.experiments.validation import validate_selections
    from circuitkit.scoring.causal import has_causal_columns

    o, out, k, n_random = job.opts, job.out, job.opts.k, job.opts.n_random
    _log(o.progress, f"{at} validation: the top {k} heads of each phase patched together on "
                     f"{_on(job.samples, 'validate')}, against {n_random} random {k}-head sets")
    # the score and the causal top sets share each (phase, direction)'s run: one engine,
    # their distinct sets once (validate_selections)
    selections = {"score": SCORE_POOLS}
    if has_causal_columns(job.scores):  # stages: the causal top sets are validated too
        _log(o.progress, f"{at} validation: and the causal top {k} heads of each phase, "
                         f"against {n_random} all-layers and layer-stratified sets, in the "
                         "same runs")
        selections["causal"] = ("all-layers", "layer-stratified")
    got = validate_selections(job.model, job.held_out, job.scores, selections, k, n_random,
                              o.seed, options=dict(
                                  batch_size=o.batch_size, progress=o.progress, sequential=True,
                                  checkpoint=out / "checkpoints" / "validation"))
    val = got["score"]
    files.write_text(out / "validation.csv", val.to_csv(index=False))
    job.summary["validation_sets"] = val.attrs.get("sets")
    written = ["validation.csv"]
    if "causal" in got:
        cval = got["causal"]
        files.write_text(out / "validation-causal.csv", cval.to_csv(index=False))
        job.summary["causal_validation"] = causal_validation(cval)
        written.append("validation-causal.csv")
    return written


def _bins(job: _Job, at: str) -> list[str]:
    _log(job.opts.progress, f"{at} bins: the paper's experiment: the top heads by the "
                            f"descriptive scores patched together in cumulative bins (pattern "
                            f"and z, both directions) beside the lowest-ranked and random heads, "
                            f"on {_on(job.samples, 'validate')}")
    return _bins_step(job.model, job.held_out, job.scores, job.phases, job.out, job.opts.seed,
                      job.opts.batch_size)


def _ablation(job: _Job, at: str) -> list[str]:
    """The top ``k`` heads of each phase ablated (``job.ablations``) on the held-out notes,
    against random sets: ``head-ablation.csv``."""
    from circuitkit import files
    from circuitkit.experiments.validation import ablate_heads

    o = job.opts
    how = "zero-, mean- and resample-ablated" if "resample" in job.ablations else (
        "zero- and mean-ablated (resample skipped: one prompt)")
    _log(o.progress, f"{at} ablation: the top {o.k} heads of each phase {how} on "
                     f"{_on(job.samples, 'validate')}, against {o.n_random_ablation} random "
                     f"{o.k}-head sets")
    abl = ablate_heads(job.model, job.held_out, job.scores, k=o.k, n_random=o.n_random_ablation,
                       seed=o.seed, ablations=job.ablations, options=dict(
                           batch_size=o.batch_size, progress=o.progress,
                           checkpoint=job.out / "checkpoints" / "validation"))
    files.write_text(job.out / "head-ablation.csv", abl.to_csv(index=False))
    return ["head-ablation.csv"]


def _edges(job: _Job, at: str) -> list[str]:
    _log(job.opts.progress, f"{at} edges")
    return _edges_step(job.model, job.per_phase_chosen, job.scores, job.opts.k, job.out,
                       job.opts.batch_size, job.opts.progress, job.meta)


def _finish(job: _Job, record: StepRecord) -> dict[str, Any]:
    """The lead (with the stage sweeps), whether every step is done, the timings; the summary
    written, then the report (always rewritten: a view of the folder, cheap next to the steps)."""
    from circuitkit import files

    summary, steps, o = job.summary, record.steps, job.opts
    if job.stages:  # the lead: where each decision is made, stable heads, the claims table
        summary.update(_json_safe(lead_picture(job.out, summary, job.scores, o.k, o.seed)))
    summary["complete"] = all(step in steps for step in summary["steps_expected"])
    summary["steps_run_this_call"] = record.ran
    summary["seconds_this_call"] = round(time.perf_counter() - job.t_all, 3)
    summary["seconds_all_steps"] = round(sum(s["seconds"] for s in steps.values()), 3)
    files.write_json(job.out / "summary.json", summary)
    if o.report:
        from circuitkit.experiments.report import write_report

        t0 = time.perf_counter()
        path = write_report(job.out, model=job.model, task=job.task)
        _log(o.progress, f"report: {path.stat().st_size / 1e6:.1f} MB in "
                         f"{time.perf_counter() - t0:.1f} s")
    _log(o.progress, timing_line(summary, time.perf_counter() - job.t_all))
    return summary


def _bins_step(model: Any, task: Any, scores: Any, phases: list[int], out: Path, seed: int,
               batch_size: int | None) -> list[str]:
    """``experiments.bins.cumulative_bins`` of each phase's ranking by its descriptive score
    (``top_heads`` over every head) on ``task``: ``out/bins/bins.csv`` (every set),
    ``bins/summary.csv`` (``bin_summary``) and ``bins/bins.html`` (``bins_figure``)."""
    from circuitkit import files, hooks
    from circuitkit.experiments.bins import bin_summary, bins_figure, cumulative_bins
    from circuitkit.scoring.heads import scored_phases, top_heads

    f = hooks.facts(model)
    rankings = {p: top_heads(scores, p, f.n_layers * f.n_heads) for p in phases
                if p in scored_phases(scores)}
    sites = _patchable_sites(model, task.clean_tokens)
    if not sites:
        return []
    frame = cumulative_bins(model, task, rankings, sites=sites, seed=seed,
                            batch_size=batch_size, checkpoint=out / "checkpoints" / "bins")
    summ = bin_summary(frame)
    (out / "bins").mkdir(exist_ok=True)
    files.write_text(out / "bins" / "bins.csv", frame.to_csv(index=False))
    files.write_text(out / "bins" / "summary.csv", summ.to_csv(index=False))
    html = bins_figure(summ).to_html(include_plotlyjs="../plotly.min.js", full_html=True)
    files.write_text(out / "bins" / "bins.html", html)
    return ["bins/bins.csv", "bins/summary.csv", "bins/bins.html"]


def _patchable_sites(model: Any, tokens: Any) -> list[str]:
    """The bins' sites an edit reaches on ``model`` (``hooks.check_patchable``): GPT-J's
    ``hook_pattern`` fires after its attention ran, so patching it would show no effect for
    every set; such a site is left out of the bins, with a warning saying why."""
    from circuitkit import hooks
    from circuitkit._warn import warn
    from circuitkit.experiments.bins import SITES

    kept = []
    for site in SITES:
        try:
            hooks.check_patchable(model, site, tokens)
            kept.append(site)
        except ValueError as e:
            warn(f"circuitkit: the cumulative bins leave out site {site!r}: {e}")
    return kept


def lead_picture(out: Path, summary: dict[str, Any], scores: Any, k: int,
                 seed: int = 0) -> dict[str, Any]:
    """``summary["lead"]`` (``experiments.claims.decision_picture`` of the stage sweeps in
    ``out/groups``: selection notes, and the held-out notes when there are any) and
    ``summary["claims"]`` (``experiments.claims.claims`` with ``validation.csv`` and
    ``validation-causal.csv``); {} without the stage sweeps."""
    import pandas as pd

    from circuitkit.experiments.claims import bins_facts, claims, decision_picture, validation_facts

    phases = summary.get("phases") or []
    sel = {(p, d): _stored(out / "groups" / f"patch-p{p}-{d}") for p in phases
           for d in ("noise", "denoise")}
    sel = {key: r for key, r in sel.items() if r is not None}
    if not sel:
        return {}
    held = {(p, d): _stored(out / "groups" / f"heldout-patch-p{p}-{d}") for p, d in sel
            if (out / "groups" / f"heldout-patch-p{p}-{d}.json").is_file()}
    held = {key: r for key, r in held.items() if r is not None} or None
    if held is not None and {p for p, _ in held} != {p for p, _ in sel}:
        held = None  # (a phase without held-out notes: the selection notes stand in for all)
    edited = {int(key[5:]): v.get("note_edited")
              for key, v in (summary.get("corruption") or {}).items()}
    picture = decision_picture(sel, held, scores, k, edited, seed=seed)

    def read(name: str) -> Any:
        return pd.read_csv(out / name) if (out / name).is_file() else None

    cval, bins = read("validation-causal.csv"), read("bins/summary.csv")
    for p in phases:
        if f"phase{p}" in picture:
            picture[f"phase{p}"]["validated"] = validation_facts(cval, p)
            picture[f"phase{p}"]["bins"] = bins_facts(bins, p)
    return dict(lead=picture, claims=claims(picture, read("validation.csv"), cval, summary))


def timing_line(summary: dict[str, Any], seconds: float) -> str:
    """How long this call took, and on what: the steps it computed, the steps it reused."""
    steps = summary.get("steps", {})
    ran = [s for s in summary.get("steps_run_this_call", []) if s in steps]
    reused = [s for s in steps if s not in ran]
    spent = sum(steps[s]["seconds"] for s in ran)
    parts = []
    if ran:
        parts.append(f"{spent:.1f} s computing {len(ran)} step{'s' if len(ran) > 1 else ''}")
    if reused:
        before = sum(steps[s]["seconds"] for s in reused)
        parts.append(f"{len(reused)} step{'s' if len(reused) > 1 else ''} reused from the "
                     f"folder (they had taken {before:.1f} s)")
    parts.append(f"{seconds - spent:.1f} s loading, writing and drawing the report")
    return f"took {seconds:.1f} s: " + ", ".join(parts)


def stability(scores: Any, phases: list[int], k: int) -> dict[str, Any]:
    """``summary["stability"]``: per phase, the top-``k`` heads with their bootstrap inclusion
    and rank interval, and those included in fewer than ``STABLE_MIN`` of the resamples."""
    from circuitkit.scoring.heads import STABLE_MIN, top_heads

    out: dict[str, Any] = {}
    idx = scores.set_index(["layer", "head"])
    for p in phases:
        inc = f"phase{p}_inclusion"
        if inc not in idx.columns:  # a scores.csv from before the bootstrap
            continue
        top = top_heads(scores, p, k)
        rows = [dict(head=[la, h], rank=_int(idx.loc[(la, h), f"phase{p}_rank"]),
                     inclusion=float(idx.loc[(la, h), inc]),
                     rank_low=_int(idx.loc[(la, h), f"phase{p}_rank_low"]),
                     rank_high=_int(idx.loc[(la, h), f"phase{p}_rank_high"])) for la, h in top]
        out[f"phase{p}"] = dict(k=int(k), top=rows, unstable=[
            r["head"] for r in rows if not r["inclusion"] >= STABLE_MIN])
    return out


def _int(x: Any) -> int | None:
    import pandas as pd

    return None if pd.isna(x) else int(x)


def _json_safe(x: Any) -> Any:
    """``x`` with NaN as None and numpy scalars as Python numbers (summary.json stays JSON)."""
    import math

    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, str):
        x = x.item()
    if isinstance(x, float) and math.isnan(x):
        return None
    return x


def causal_validation(val: Any) -> dict[str, Any]:
    """``summary["causal_validation"]``: per phase, the causal top set (``validate_heads(...,
    selection="causal")``, noise, the phase's metric) on the validation notes: ``heads``,
    ``normalized`` (its joint effect as a share of the gap; NaN and ``degenerate`` True when
    the corruption does not lower the metric), ``effect`` (the raw joint effect), and per pool
    ``p`` with its Monte Carlo interval and ``n_random``."""
    from circuitkit.patching.results.patch_result import degenerate_baseline
    out: dict[str, Any] = {}
    rows = val[(val["direction"] == "noise")]
    for phase, part in rows.groupby("phase"):
        part = part[part["quantity"] == part["quantity"].iloc[0]]  # the phase's metric first
        first = part.iloc[0]
        # the phase's metric: the one degenerate-baseline rule (no share of a gap the
        # corruption does not open: "moves anchor_margin by nan% of the gap", before)
        degenerate = degenerate_baseline(float(first["clean"]), float(first["corrupt"]))
        out[f"phase{int(phase)}"] = dict(
            heads=str(first["heads"]), quantity=str(first["quantity"]),
            normalized=float("nan") if degenerate else float(first["normalized"]),
            effect=float(first["top_effect"]), degenerate=bool(degenerate),
            n_prompts=int(first["n_prompts"]),
            pools={str(r["pool"]): dict(p=float(r["p_value"]), p_low=float(r["p_low"]),
                                        p_high=float(r["p_high"]), n_random=int(r["n_random"]))
                   for _, r in part.iterrows()})
    return out


def _edges_step(model: Any, per_phase: dict[int, Any], scores: Any, k: int, out: Path,
                batch_size: int | None, progress: bool, meta: dict[str, Any]) -> list[str]:
    """Exact edges from the top ``k`` Phase-1 heads (senders) into the top ``k`` Phase-2 heads after
    the earliest of them (receivers), q/k/v, on the Phase-2 task and metric (one phase only: its top
    heads into themselves); their faithfulness curve (``circuit.json``); the same pairs through
    everything between them (``paths.*``, ``patch_paths`` per ``stage_groups`` group; its coverage
    is the edges' ``meta["path_coverage"]``). Writes ``out/edges/``; returns the files written
    (relative to ``out``), none when no receiver lies after a sender."""
    import circuitkit as ck
    from circuitkit import hooks
    from circuitkit.scoring.heads import top_heads

    phases = sorted(per_phase)
    senders = top_heads(scores, phases[0], k)
    first = min(la for la, _ in senders)
    receivers = [h for h in top_heads(scores, phases[-1], k) if h[0] > first]
    if not receivers:
        _log(progress, f"edges: no top Phase-{phases[-1]} head lies after a top "
                       f"Phase-{phases[0]} head; nothing to patch")
        return []
    tp = per_phase[phases[-1]]
    folder = out / "edges"
    res = ck.patch_edges(model, tp.clean_tokens, tp.corrupt_tokens, tp.metric, senders, receivers,
                         options=dict(batch_size=batch_size, checkpoint=out / "checkpoints" /
                         "edges", progress=progress, task_hash=tp.fingerprint()))
    res.meta.update(meta, phase=phases[-1], n_examples=len(tp), senders_from=f"phase{phases[0]}",
                    receivers_from=f"phase{phases[-1]}")
    # the same senders and receivers through everything between them (MLPs, other heads, other
    # positions), each route restricted to one stage's positions: what the q/k/v edges miss
    groups = stage_groups(tp)
    shared_kv = hooks.facts(model).gqa  # a k/v input is several heads' (patch_paths: q only)
    paths = ck.patch_paths(model, tp.clean_tokens, tp.corrupt_tokens, tp.metric, senders,
                           receivers, inputs=("q",) if shared_kv else tuple(res.inputs),
                           direction=res.direction, positions=groups,
                           options=dict(batch_size=batch_size,
                                        checkpoint=out / "checkpoints" / "paths", progress=progress,
                                        task_hash=tp.fingerprint()))
    paths.meta.update(meta, phase=phases[-1], n_examples=len(tp))
    paths.save(folder / "paths", views=False)
    res.meta["path_coverage"] = {g: row["overall"] for g, row in paths.meta["coverage"].items()}
    res.save(folder / "edges", views=False)
    circ = ck.circuit(model, tp, res, options=dict(batch_size=batch_size, progress=progress))
    circ.save_json(folder / "circuit.json")
    return ["edges/edges.safetensors", "edges/edges.json", "edges/paths.safetensors",
            "edges/paths.json", "edges/circuit.json"]


STAGE_TOP = 5  # cells per (phase, direction) in summary["stages"]


def stage_groups(task: Any) -> dict[str, Any]:
    """The position groups ``characterize``'s stages step (and the edge step's paths) patch:
    ``scoring.causal.causal_groups(task, "steps")``: evidence at its tokens, anchor, shortlist
    and answer at the steps that write them (each token's position - 1; "answer" is where the
    phase's metric reads), and "all". One meaning of "the shortlist positions" in a run."""
    from circuitkit.scoring.causal import causal_groups

    return causal_groups(task, "steps")


def _stages_step(model: Any, per_phase: dict[int, Any], out: Path, k: int,
                 batch_size: int | None, progress: bool, meta: dict[str, Any],
                 summary: dict[str, Any], held: dict[int, Any] | None = None) -> list[str]:
    """Exact ``[layer, head, group]`` sweeps over each phase's ``stage_groups`` (on the
    selection notes), denoise and noise: ``out/groups/patch-p{phase}-{direction}.*``
    (PatchResult); from the same sweeps ``out/causal.csv`` (``causal.causal_frame``) and the
    summary's ``phase_table`` (top ``k``) and ``stages`` (per phase and direction the group
    names and the ``STAGE_TOP`` cells with the largest ``|normalized|``). ``held``: per phase
    the held-out notes' task: the same sweeps on them, ``out/groups/heldout-patch-p*``
    (``lead_picture`` measures where each decision is made on them)."""
    import circuitkit as ck
    from circuitkit import files, hooks
    from circuitkit.patching.results import quiet_baseline
    from circuitkit.scoring.causal import causal_frame, phase_table

    def sweep(tp: Any, phase: int, direction: str, step: str, **more: Any) -> Any:
        with quiet_baseline():  # (said once per phase by the whole-head sweeps)
            res = ck.patch_heads(model, tp.clean_tokens, tp.corrupt_tokens, tp.metric,
                                 direction=direction, positions=stage_groups(tp),
                                 options=dict(batch_size=batch_size, progress=progress,
                                              checkpoint=out / "checkpoints" / f"groups-{step}",
                                              task_hash=tp.fingerprint()))
        res.meta.update(meta, phase=phase, n_examples=len(tp), **more)
        res.save(out / "groups" / step, views=False)
        written.extend([f"groups/{step}.safetensors", f"groups/{step}.json"])
        return res

    written, said, sweeps = [], {}, {}
    for phase, tp in (held or {}).items():  # the same sweeps on the held-out notes: the lead's
        # "where" and its intervals are measured on notes the cells were not chosen on (noise,
        # the direction the lead reads: removing what the phase needs)
        if len(tp):
            sweep(tp, phase, "noise", f"heldout-patch-p{phase}-noise", sample="held-out")
    for phase, tp in per_phase.items():
        for direction in ("denoise", "noise"):
            with quiet_baseline():
                res = sweep(tp, phase, direction, f"patch-p{phase}-{direction}")
                norm = res.normalized()
            sweeps[(phase, direction)] = (res, tp)
            flat = norm.abs().nan_to_num(0).flatten()
            top = flat.argsort(descending=True)[:STAGE_TOP].tolist()
            L, H, G = norm.shape
            said.setdefault(f"phase{phase}", {})[direction] = dict(
                groups=list(res.meta["group_names"]), top=[
                    dict(head=[c // (H * G), (c // G) % H],
                         group=res.meta["group_names"][c % G],
                         normalized=round(float(norm.flatten()[c]), 4)) for c in top])
    f = hooks.facts(model)
    table = causal_frame(f.n_layers, f.n_heads, sweeps, "steps")
    from circuitkit.escape import csv_frame  # (group names: no spreadsheet formulas)

    files.write_text(out / "causal.csv", csv_frame(table).to_csv(index=False))
    summary["stages"] = said
    summary["causal_attrs"] = _json_safe(table.attrs)
    summary["phase_table"] = _json_safe(phase_table(table, k=k))
    return written + ["causal.csv"]


def _on(samples: dict[str, Any], role: str) -> str:
    """Which notes a step runs on, in words: "examples 0-63 (the selection sample)", "examples
    64-127 (held out)", or "the 128 examples" (one sample for both)."""
    a, b = samples[role]["examples"]
    if not samples["held_out"]:
        return f"the {b - a} examples"
    return f"examples {a}-{b - 1} (" + ("the selection sample)" if role == "select" else
                                        "held out)")


def _select_n(select_n: int | str | None, n: int) -> tuple[int | None, list[str]]:
    """``select_n`` resolved for ``n`` examples ("half": ``n // 2``), and the line saying why a
    held-out sample was not drawn (one example cannot be split)."""
    if select_n != "half":
        if isinstance(select_n, str):
            raise ValueError(f"select_n={select_n!r}: expected a number of examples, 'half' "
                             "or None.")
        return select_n, []
    if n >= 2:
        return n // 2, []
    return None, ["held-out validation skipped: one example cannot be split into a selection "
                  "and a validation sample; heads were selected and validated on it."]


def selection_samples(task: Any, select_n: int | None, seed: int
                      ) -> tuple[Any, Any, dict[str, Any]]:
    """The sample heads are selected on (scores, causal columns) and the one they are validated
    on (validation, ablation): ``task`` for both when ``select_n`` is None; else its first
    ``select_n`` examples and the rest (disjoint). Each named by seed, n, examples and the
    fingerprint (hash) of its examples."""
    def named(t: Any, first: int) -> dict[str, Any]:
        return dict(seed=seed, n=len(t), examples=[first, first + len(t)],
                    hash=t.fingerprint())

    if select_n is None:
        same = named(task, 0)
        return task, task, dict(select=same, validate=same, held_out=False)
    if not 1 <= int(select_n) < len(task):
        raise ValueError(f"select_n must be in 1..{len(task) - 1} (the task has {len(task)} "
                         f"examples; the rest validate); got {select_n!r}.")
    chosen, rest = task.subset(range(int(select_n))), task.subset(range(int(select_n),
                                                                          len(task)))
    rest, repeats = _held_out(chosen, rest, int(select_n))
    validate = named(rest, int(select_n))
    validate["examples"] = [int(select_n), len(task)]
    if repeats:  # (the findings say so beside the range)
        validate["left_out"] = repeats
    return chosen, rest, dict(select=named(chosen, 0), validate=validate, held_out=True)


def _held_out(chosen: Any, rest: Any, first: int) -> tuple[Any, list[int]]:
    """``rest`` without the examples that repeat one of the selection sample (the same clean
    and corrupt tokens: a JSONL's duplicate rows, a note drawn twice), and those examples'
    indices in the task: validating on them is not held out, though the findings said so
    (both samples hashed the same, before). Nothing left: ``ValueError``."""
    def key(e: Any) -> tuple:
        return (tuple(e.tokens.tolist()), tuple(e.corrupt_tokens.tolist()))

    seen = {key(e) for e in chosen.examples}
    keep = [j for j, e in enumerate(rest.examples) if key(e) not in seen]
    repeats = [first + j for j in range(len(rest)) if j not in set(keep)]
    if not keep:
        raise ValueError(
            f"every held-out example (examples {first}-{first + len(rest) - 1}) repeats one of "
            "the selection sample (the same clean and corrupt tokens), so nothing is held out. "
            "Remove the repeated rows from the task (a JSONL's duplicate rows), or select and "
            "validate on the same examples (--select-n none / select_n=None), which the "
            "findings then say.")
    return (rest if not repeats else rest.subset(keep)), repeats


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
    from circuitkit.patching.results import DegenerateBaselineWarning

    for phase in sorted({p for p, _ in results}):
        bad = {d: r for (p, d), r in results.items() if p == phase and r is not None
               and r.degenerate}
        if bad:
            reason = next(iter(bad.values())).degenerate_reason().removeprefix("circuitkit: ")
            names = ", ".join(f"patch-p{phase}-{d}" for d in bad)
            warnings.warn(DegenerateBaselineWarning(
                f"circuitkit: phase {phase} ({names}): {reason}"), stacklevel=3)
