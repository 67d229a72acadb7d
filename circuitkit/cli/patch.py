"""``info``, ``patch`` and ``edges``: the sweep commands.
"""

from __future__ import annotations

from pathlib import Path

import typer

from circuitkit.cli import options as o
from circuitkit.cli.checks import _check_sweep_flags, _claim_out, _n_for, _one_of, _positive
from circuitkit.cli.command import Args, command
from circuitkit.cli.console import (
    _echo_json,
    _errors_as_lines,
    _fail,
    _given,
    _interrupted,
    _message,
    _same_command,
    echo,
)
from circuitkit.cli.format import (
    _describe_auto,
    _describe_scale,
    _estimate_label,
    _info_text,
    _model_list,
    _table,
)
from circuitkit.cli.load import (
    _check_vocabulary,
    _check_weights,
    _load,
    _phase_task,
    _sweep_tokens,
)
from circuitkit.cli.plan import _edge_plan, _patch_plan, _plan_offline


@command((o.INFO_MODEL, o.INFO_SEQ_LEN, o.INFO_PROMPTS, o.GPU, o.JSON),
         short_help="Architecture and sweep costs of a model (offline).")
def info(a: Args) -> None:
    """Architecture and head sweep cost plan, from the config alone (no weights needed): the
    figures ``patch --plan --seq-len`` prints for the same prompts (``patching.cost.sweep_plan``);
    without --model, the list of models known by name."""
    from circuitkit import models
    from circuitkit.patching.cost import GPU_CLASSES, sweep_plan

    model, seq_len, prompts, gpu = a.model, a.seq_len, a.prompts, a.gpu
    if model is None:
        typer.echo(_model_list())
        return
    with _errors_as_lines(models.ModelNotAvailableError, FileNotFoundError, ValueError):
        _one_of("--gpu", gpu.upper(), sorted(GPU_CLASSES))
        _positive("--seq-len", seq_len, "tokens per prompt")
        _positive("--n-examples", prompts, "prompts per sweep")
        arch = models.architecture(model)
    if seq_len is None:
        seq_len = min(512, arch.n_ctx) if arch.n_ctx else 512
    elif arch.n_ctx and seq_len > arch.n_ctx:
        _fail(f"--seq-len {seq_len} is longer than {arch.name}'s context ({arch.n_ctx} "
              f"tokens): the model cannot read such a prompt. Use --seq-len <= {arch.n_ctx}.")
    plan = sweep_plan(arch, [seq_len] * prompts, options=dict(gpu=gpu.upper()))
    if a.as_json:
        import dataclasses

        return _echo_json(dict(architecture=dataclasses.asdict(arch) if dataclasses.is_dataclass(
            arch) else vars(arch), seq_len=seq_len, n_prompts=prompts, plan=plan))
    typer.echo(_info_text(arch, plan))


# --- patch ----------------------------------------------------------------------------------------
PATCH = (o.MODEL, o.TASK, o.N, o.DIRECTION, o.METHOD.with_default("auto"), o.POSITIONS, o.SITE,
         o.PHASE, o.CORRUPTION, o.SPLIT, o.SEED, o.BATCH_SIZE, o.TOP_K, o.MAX_PASSES,
         o.HEAD_ESTIMATOR, o.OUT.with_default(Path("patch-out")), o.OVERWRITE, o.CHECKPOINT,
         o.PLAN, o.SEQ_LEN, o.GPU, o.UTILISATION, o.GPUS_PER_REPLICA, o.BACKEND, o.REMOTE,
         o.PROGRESS, o.JSON)


@command(PATCH, short_help="Activation patching of every head (or layer).")
def patch(a: Args) -> None:
    """Activation-patching sweep over heads (or layers): writes
    OUT/result.{safetensors,json,csv,html} and prints the strongest cells."""
    with _errors_as_lines():
        _check_patch_flags(a)
    if not (a.plan or a.remote):  # missing weights: said before any model loads or --out is made
        _check_weights(a.model)
    from circuitkit import hooks, models

    if a.plan and (a.seq_len is not None or not models.weights_available(a.model)):
        _plan_offline(a, n_gpus=a.gpus_per_replica if _given(a.ctx, "gpus_per_replica")
                      else None)
        return
    layout, leader = _replicas(a.ctx, a)
    if not leader:
        return
    the_model, the_task, (clean, corrupt, metric) = _patch_inputs(a, layout)
    unit = "layers x positions" if a.site in hooks.PATCH_LAYER_SITES else "heads"
    phase = "" if the_task.phase is None else f" Phase {the_task.phase}"  # pairs: no phases
    what = (f"{a.model} on {the_task.name}{phase}, metric {metric.name}, "
            f"{a.direction}, {unit} at site {a.site}")
    if a.plan:
        return _patch_plan(a, the_model, clean, corrupt, metric)
    from circuitkit.patching import distributed

    _say_start(a, what, len(clean))
    res = _run_patch(a.ctx, a, the_model, the_task, clean, corrupt, metric)
    if distributed.rank_world()[0] == 0:  # every replica holds the merged result; 0 writes
        res.meta.update(model_name=a.model, task=a.task, n_examples=len(clean),
                        phase=the_task.phase, split=a.split, seed=a.seed)
        with _errors_as_lines(OSError):  # a full disk: the rerun resumes from the checkpoint
            written = res.save(a.out / "result")
            estimate = _estimate_label(res)
        _print_patch(a, res, what, metric, len(clean), estimate, written)


def _say_start(a, what: str, n: int) -> None:
    """The run's header, on stderr; under torchrun said once, not once per rank."""
    from circuitkit.patching import distributed

    how = "clean into corrupt" if a.direction == "denoise" else "corrupt into clean"
    if distributed.rank_world()[0] == 0:
        echo(f"patching {what} ({how} runs), {n} prompts, method {a.method}", err=True)


def _check_patch_flags(a) -> None:
    """``patch``'s flags, before anything loads."""
    from circuitkit import hooks
    from circuitkit.patching.inputs import BACKENDS, METHODS, POSITIONS

    _check_sweep_flags(a)
    _one_of("--method", a.method, METHODS)
    _one_of("--site", a.site, hooks.PATCH_HEAD_SITES + hooks.PATCH_LAYER_SITES)
    layer_site = a.site in hooks.PATCH_LAYER_SITES
    if a.positions is None:
        a.positions = "each" if layer_site else "all"
    _one_of("--positions", a.positions, POSITIONS)
    _one_of("--backend", a.backend, BACKENDS)
    if a.estimator is not None:  # before the model loads (the library would say it after)
        from circuitkit.patching.estimators.registry import ESTIMATORS

        _one_of("--estimator", a.estimator, ESTIMATORS)
    if layer_site and (a.method not in ("exact", "auto") or a.plan):
        raise ValueError(f"--site {a.site} (a layer site) supports --method exact without "
                         "--plan only.")
    if layer_site and a.positions != "each":
        raise ValueError(f"--site {a.site} (a layer site) patches one position at a time: use "
                         "--positions each (its default), or a head site (z, q, k, v, "
                         "pattern) for --positions all.")
    if a.remote and a.backend != "nnsight":
        raise ValueError("--remote runs through NDIF: add --backend nnsight.")
    if a.backend == "nnsight" and (layer_site or a.plan):
        raise ValueError("--backend nnsight runs head sweeps (sites z, q, k, v) without --plan.")
    if a.seq_len is not None and not a.plan:
        raise ValueError("--seq-len prices prompts of that length with --plan; a sweep runs the "
                         "task's own prompts. Add --plan, or drop --seq-len.")
    if a.remote:
        from circuitkit.patching.exact.nnsight import check_remote

        check_remote(a.model)


def _replicas(ctx, a):
    """(torchrun replica layout or None for --plan, whether this process leads a replica).
    Rank 0 holds OUT's lock and claims it for patch (every method)."""
    from circuitkit.patching import distributed

    with _errors_as_lines():
        layout = distributed.init_replicas(a.gpus_per_replica) if not a.plan else None
    if layout is not None and not layout.leader:
        typer.echo(f"rank {layout.rank}: GPU lent to replica {layout.replica} (led by rank "
                   f"{layout.rank - layout.rank % layout.procs_per_replica}); nothing to do here.")
        return layout, False
    if not a.plan and distributed.rank_world()[0] == 0:
        with _errors_as_lines(ValueError, OSError):
            _claim_out(ctx, "patch", a.out, a.overwrite, positions=a.positions,
                       n_examples=_n_for(a.task, a.n_examples))
    return layout, True


def _patch_inputs(a, layout):
    """(model, task of its phase, (clean, corrupt, metric)) for ``patch`` (``layout``: its
    torchrun replicas, or None)."""
    if a.backend == "nnsight":
        from circuitkit.patching.exact import nnsight as nnsight_backend

        the_model, the_task = _load(a.model, a.task, a.n_examples, a.seed, a.split, a.phase,
                                    loader=lambda m: nnsight_backend.load(m, remote=a.remote),
                                    pairs=True, corruption=a.corruption,
                                    progress=a.progress)
    else:
        loader = None
        if layout is not None and (layout.gpus_per_replica > 1 or layout.n_replicas > 1):
            import circuitkit as ck
            from circuitkit import models

            placement = models.replica_placement(layout.local_gpus)
            loader = lambda m: ck.load_model(m, **placement)  # noqa: E731
        the_model, the_task = _load(a.model, a.task, a.n_examples, a.seed, a.split, a.phase,
                                    loader=loader, renders=True, pairs=True,
                                    corruption=a.corruption, progress=a.progress)
        if loader is not None:
            with _errors_as_lines():
                _check_vocabulary(the_model, the_task, renders=True)
    the_task = _phase_task(the_task, a.task)
    return the_model, the_task, _sweep_tokens(the_model, the_task)


def _run_patch(ctx, a, the_model, the_task, clean, corrupt, metric):
    """The sweep itself (``api.patch_layers`` or ``api.patch_heads``), checkpointed in
    ``OUT/checkpoints/result``; Ctrl-C says what was kept and how to resume."""
    from circuitkit import hooks
    from circuitkit.files import WriteError
    from circuitkit.patching import api

    layers = a.site in hooks.PATCH_LAYER_SITES
    stores = a.method != "attribution"  # what checkpoints (nnsight too: the same sweep road)
    ckpt = _checkpoint_dir(a.out) if a.checkpoint and stores else None
    extra = {} if layers else dict(
        top_k=a.top_k, backend=a.backend, remote=a.remote, max_passes=a.max_passes,
        **({} if a.estimator is None else dict(estimator=a.estimator)))
    options = dict(batch_size=a.batch_size, progress=a.progress, checkpoint=ckpt,
                   task_hash=the_task.fingerprint(), **extra)
    try:  # WriteError: a checkpoint chunk on a full disk
        with _errors_as_lines(ValueError, WriteError):
            return (api.patch_layers if layers else api.patch_heads)(
                the_model, clean, corrupt, metric, direction=a.direction, method=a.method,
                positions=a.positions, site=a.site, options=options)
    except KeyboardInterrupt:
        if ckpt is not None:
            why = (f"finished work is in {ckpt}. Resume with the same command:\n  "
                   f"{_same_command(ctx)}")
        elif stores:  # --no-checkpoint: the library's own line above says where chunks went
            why = ("--no-checkpoint: nothing this command can resume (drop --no-checkpoint to "
                   "make the rerun resume).")
        else:
            what = "--backend nnsight" if a.backend == "nnsight" else "--method attribution"
            why = f"nothing was saved ({what} runs are not checkpointed)."
        _interrupted(why)


def _print_patch(a, res, what: str, metric, n: int, estimate: str, written) -> None:
    """``patch``'s report: what auto chose, the strongest cells, the files written."""
    top = res.top(5)
    if a.as_json:
        return _echo_json(dict(
            command="patch", what=what, method=res.method, estimate=bool(estimate),
            clean=res.clean, corrupt=res.corrupt, auto=res.meta.get("auto"),
            top=top.rename(columns={"value": "estimate"} if estimate.startswith("ESTIMATES")
                           else {}).to_dict("records"), files=[str(p) for p in written]))
    auto = res.meta.get("auto")
    if auto:
        typer.echo(_describe_auto(auto))
    echo(f"{what}: clean {res.clean:.4g}, corrupt {res.corrupt:.4g} (mean {metric.name} "
         f"over {n} prompts, {a.split} split, seed {a.seed})\n"
         f"strongest cells ({_describe_scale(res, estimate)}):\n{_table(top, estimate)}")
    for path in written:  # one line per file
        typer.echo(f"wrote {path}")


def _checkpoint_dir(out: Path) -> Path:
    """``OUT/checkpoints/result``: one folder name for every command's checkpoints
    (characterize keeps ``OUT/checkpoints/<step>``). A folder an older circuitkit wrote,
    ``OUT/checkpoint``, is moved there, so its run resumes and the folder keeps one name."""
    new, old = out / "checkpoints" / "result", out / "checkpoint"
    if old.is_dir() and not new.exists():
        try:
            new.parent.mkdir(parents=True, exist_ok=True)
            old.rename(new)
            typer.echo(f"moved {old} to {new} (checkpoints now live in one folder)", err=True)
        except OSError:  # another rank moved it first, or it cannot move: use what exists
            return new if new.exists() else old
    return new


# --- edges ----------------------------------------------------------------------------------------
EDGES = (o.MODEL, o.TASK, o.INPUTS, o.SENDERS, o.RECEIVERS, o.METHOD, o.EDGE_ESTIMATOR,
         o.IG_STEPS, o.TOP_K, o.DIRECTION, o.N, o.PHASE, o.CORRUPTION, o.SPLIT, o.SEED,
         o.BATCH_SIZE, o.CIRCUIT, o.EDGE_ABLATION, o.OUT.with_default(Path("edges-out")),
         o.OVERWRITE, o.CHECKPOINT, o.PLAN, o.GPU, o.UTILISATION, o.PROGRESS, o.JSON)


@command(EDGES, short_help="Which heads feed which heads' q, k, v: edge patching.")
def edges(a: Args) -> None:
    """Edge patching: which heads feed which heads' q/k/v (and the logits); writes
    OUT/edges.{safetensors,json,csv,html}, with --circuit OUT/circuit.json and its pictures."""
    from circuitkit.patching.inputs import EDGE_METHODS

    with _errors_as_lines():
        _check_sweep_flags(a)
        _one_of("--method", a.method, EDGE_METHODS)
        if a.estimator is not None:  # before the model loads
            from circuitkit.patching.estimators.registry import EDGE_ESTIMATORS

            _one_of("--estimator", a.estimator, EDGE_ESTIMATORS)
        _positive("--ig-steps", a.ig_steps, "interpolation steps")
    if not a.plan:
        _check_weights(a.model)  # missing weights: said before any model loads or --out is made
        with _errors_as_lines(ValueError, OSError):
            _claim_out(a.ctx, "edges", a.out, a.overwrite,
                       n_examples=_n_for(a.task, a.n_examples))
    a.nodes = {k: None if v.strip() == "all" else [p.strip() for p in v.split(",") if p.strip()]
               for k, v in (("senders", a.senders), ("receivers", a.receivers))}
    if a.plan:
        return _edge_plan(a)
    the_model, the_task = _load(a.model, a.task, a.n_examples, a.seed, a.split, a.phase,
                                renders=True, pairs=True, corruption=a.corruption,
                                progress=a.progress)
    the_task = _phase_task(the_task, a.task)
    clean, corrupt, metric = _sweep_tokens(the_model, the_task)
    res, circ, written = _run_edges(a.ctx, a, the_model, the_task, clean, corrupt, metric)
    _print_edges(a, res, circ, written)


def _run_edges(ctx, a, the_model, the_task, clean, corrupt, metric):
    """(edge result, circuit or None, files written): ``ck.patch_edges`` (exact: checkpointed
    in ``OUT/checkpoints/edges``), then ``ck.circuit`` (in ``OUT/checkpoints/circuit``); Ctrl-C
    says what was kept."""
    import circuitkit as ck

    ckpt = (a.out / "checkpoints" / "edges" if a.checkpoint and a.method != "attribution"
            else None)  # exact chunks; attribution+exact: the screen and verified cells
    try:
        res = ck.patch_edges(the_model, clean, corrupt, metric, a.nodes["senders"],
                             a.nodes["receivers"], a.inputs, direction=a.direction,
                             method=a.method,
                             options=dict(estimator=a.estimator, ig_steps=a.ig_steps, top_k=a.top_k,
                                          batch_size=a.batch_size, checkpoint=ckpt,
                                          progress=a.progress, task_hash=the_task.fingerprint()))
        res.meta.update(model_name=a.model, task=a.task, n_examples=len(clean),
                        phase=the_task.phase, split=a.split, seed=a.seed)
        written = res.save(a.out / "edges")
        res.estimate = _estimate_label(res)
        circ = ck.circuit(the_model, (clean, corrupt, metric), res, ablation=a.ablation,
                          options=dict(batch_size=a.batch_size, progress=a.progress,
                                       checkpoint=None if ckpt is None else ckpt.parent
                                       / "circuit")) if a.circuit else None
        if circ is not None:
            written += _save_circuit(circ, a.out)
    except (ValueError, OSError) as e:  # OSError: files.WriteError, a full disk
        _fail(_message(e))
    except KeyboardInterrupt:
        _interrupted(f"finished chunks are in {ckpt.parent}. Resume with the same command:\n  "
                     f"{_same_command(ctx)}" if ckpt is not None else "nothing was saved.")
    return res, circ, written


def _save_circuit(circ, out: Path) -> list[Path]:
    """``OUT/circuit.json`` and its pictures (the graph, the faithfulness curve)."""
    from circuitkit.patching.results import write_page
    from circuitkit.viz.edges import circuit_graph, faithfulness_curve

    written = [circ.save_json(out / "circuit.json")]
    for name, fig in (("circuit.html", circuit_graph(circ) if circ.kept() else None),
                      ("faithfulness.html", faithfulness_curve(circ))):
        if fig is not None:  # the folder's one plotly.min.js, like edges.html beside them
            written.append(write_page(fig, out / name))
    return written


def _print_edges(a, res, circ, written) -> None:
    """``edges``' report: the strongest edges (estimates labelled), the circuit, the files."""
    estimate = res.estimate
    cols = ["sender", "receiver", "input", "value", res.value_column] + (
        ["ci_low", "ci_high"] if res.per_prompt is not None else []) + (
        ["verified"] if "verified" in res.top(1) else [])
    top = res.top(10)[cols]
    if a.as_json:
        return _echo_json(dict(
            command="edges", what=str(res), method=res.method, estimate=bool(estimate),
            top=top.to_dict("records"), circuit=None if circ is None else str(circ),
            files=[str(p) for p in written]))
    scale = _describe_scale(res, estimate).removesuffix(", -1 = fully broken")
    echo(f"{_edges_header(res)}\nstrongest edges ({scale}):\n{_table(top, estimate)}")
    if circ is not None:
        echo(f"{circ}\n" + circ.to_frame().to_string(
            index=False, float_format=lambda v: f"{v:.3f}"))
    for path in written:  # one line per file
        typer.echo(f"wrote {path}")


def _edges_header(res) -> str:
    """What an edge sweep was, as a small table (not the ``EdgeResult(...)`` repr)."""
    meta = res.meta or {}
    n = int(res.edge_mask().sum())
    how = res.method + (f" (estimator {meta['estimator']})" if meta.get("estimator") else "")
    rows = [("edges", f"{len(res.senders)} senders x {len(res.receivers)} receivers, inputs "
                      f"{', '.join(res.inputs)}: {n:,} edges"),
            ("method", f"{how}, {res.direction}"),
            ("metric", f"{meta.get('metric') or 'the metric'}: clean {res.clean:.4g}, corrupt "
                       f"{res.corrupt:.4g}" + (f" (mean over {meta['n_examples']} prompts)"
                                               if meta.get("n_examples") else ""))]
    return "\n".join(f"{k:<8}{v}" for k, v in rows)
