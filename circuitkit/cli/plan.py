"""``--plan`` of patch and edges: prints what ``patching.cost`` prices for the prompts a run
would read (its text: ``plan_text``).
"""

from __future__ import annotations

import typer

from circuitkit.cli.console import _echo_json, _errors_as_lines, _fail
from circuitkit.cli.format import format_plan
from circuitkit.cli.load import _load, _phase_task, _sweep_tokens
from circuitkit.experiments.characterize import DEFAULT_N


def _patch_plan(a, the_model, clean, corrupt, metric) -> None:
    """``patch --plan`` with the weights here: ``api.plan_patch``'s one-chunk probe."""
    from circuitkit.patching import api
    from circuitkit.patching.units import HeadUnits

    with _errors_as_lines():
        p = api.plan_patch(the_model, clean, corrupt, metric,
                           HeadUnits(a.site, a.positions), method=a.method,
                           options=dict(top_k=a.top_k, estimator=a.estimator, direction=a.direction,
                                        batch_size=a.batch_size))
    if a.as_json:
        return _echo_json(p)
    typer.echo(format_plan(p))


def _edge_plan(a) -> None:
    """``edges --plan``: ``patching.cost.edge_plan`` for the prompts the run would read. With
    the weights here, the model loads and the prompts are the run's own (the task's phase,
    rendered as the run renders it; lengths before right padding); else the model's config
    and the task's token counts."""
    from circuitkit import models
    from circuitkit.cli.plan_text import format_edge_plan
    from circuitkit.patching.cost import edge_plan
    from circuitkit.patching.inputs import check_edge_nodes
    from circuitkit.patching.sweep import EdgeLayout

    with _errors_as_lines(models.ModelNotAvailableError, FileNotFoundError, ValueError):
        arch = models.architecture(a.model)
    n_params = None
    if models.weights_available(a.model):
        lengths, how, n_params = _run_lengths(a)
    else:
        lengths, how = _task_lengths(a)
    with _errors_as_lines():
        s, r, i = check_edge_nodes(arch, a.nodes["senders"], a.nodes["receivers"], a.inputs)
        layout = EdgeLayout(arch.n_layers, arch.n_heads, arch.n_kv_heads, s, r, i)
        kw = dict(direction=a.direction, ig_steps=a.ig_steps or 5, options=dict(
            gpu=a.gpu.upper(), utilisation=a.utilisation, rows=a.batch_size))
        p = edge_plan(arch, lengths, layout, top_k=a.top_k, **kw)
        if a.top_k is None and a.method == "attribution+exact":  # what a smaller budget costs
            k = max(1, min(50, p["methods"]["attribution+exact"]["verified_edges"] // 5))
            p["top_k_hint"] = (k, edge_plan(arch, lengths, layout, top_k=k, **kw)
                               ["methods"]["attribution+exact"])
    if n_params is not None:
        p["n_params"], p["measured"] = n_params, True
    p["chosen"] = a.method if a.method != "attribution" else (a.estimator or "eap")
    if a.as_json:
        return _echo_json(p)
    typer.echo(format_edge_plan(p, how))


def _run_lengths(a):
    """(token counts before right padding, how they were counted, parameters) of the prompts
    an ``edges`` run reads: the model loads, the task's phase is taken and rendered as the run
    renders it."""
    from circuitkit.patching.inputs import pad_token_id, padded_lengths

    the_model, the_task = _load(a.model, a.task, a.n_examples, a.seed, a.split, a.phase,
                                renders=True, pairs=True)
    clean, corrupt, _ = _sweep_tokens(the_model, _phase_task(the_task, a.task))
    real = padded_lengths(clean, corrupt, pad_token_id(the_model))
    lengths = [int(x) for x in real] if real is not None else [clean.shape[1]] * len(clean)
    return (lengths, "the run's own prompts (weights here: measured)",
            sum(p.numel() for p in the_model.parameters()))


def _task_lengths(a):
    """(token counts, how) of the prompts of a sweep's task phase without the model's weights
    (``--plan``): a text task's texts through the model's tokenizer, else the task's own
    tokens."""
    from circuitkit import models
    from circuitkit.tasks import TOKENIZER_TASKS
    from circuitkit.tasks.text import TEXT_TASKS, prompt_texts, token_counts

    tok = models.local_tokenizer(a.model) if a.task in TOKENIZER_TASKS else None
    if tok is not None:  # capitals: text in the model's own tokenizer (its files are here)
        import circuitkit as ck

        with _errors_as_lines(FileNotFoundError, ValueError, OSError):
            the_task = ck.load_task(a.task, n_examples=a.n_examples or DEFAULT_N, seed=a.seed,
                                    split=a.split, phase=a.phase, tokenizer=tok)
    else:
        _, the_task = _load(None, a.task, a.n_examples, a.seed, a.split, a.phase,
                            pairs=True)
    the_task = _phase_task(the_task, a.task)
    if the_task.name in TEXT_TASKS:
        return token_counts(prompt_texts(the_task), models.local_tokenizer(a.model))
    return ([int((e.tokens != the_task.pad_id).sum()) for e in the_task.examples],
            "token counts of the task's tokens")


def _plan_offline(a, *, n_gpus=None) -> None:
    """``patch --plan`` without the weights: ``patching.cost.sweep_plan`` from the config, for
    the task's prompts (their token counts), or ``-n`` prompts of ``--seq-len`` tokens (the
    prompts ``circuitkit info`` prices)."""
    from circuitkit import models
    from circuitkit.cli.plan_text import format_sweep_plan
    from circuitkit.patching.cost import sweep_plan

    with _errors_as_lines(models.ModelNotAvailableError, FileNotFoundError, ValueError):
        arch = models.architecture(a.model)
    if a.seq_len is not None:
        if a.seq_len < 1 or (arch.n_ctx and a.seq_len > arch.n_ctx):
            _fail(f"--seq-len must be in 1..{arch.n_ctx or 'the context'} ({arch.name}'s "
                  f"context); got {a.seq_len}.")
        n = a.n_examples or DEFAULT_N
        lengths, how = [a.seq_len] * n, f"--seq-len: {n} prompts of {a.seq_len} tokens each"
    else:
        lengths, how = _task_lengths(a)
    with _errors_as_lines():
        p = sweep_plan(arch, lengths, site=a.site, positions=a.positions, direction=a.direction,
                       top_k=a.top_k, options=dict(gpu=a.gpu.upper(), utilisation=a.utilisation,
                                                   rows=a.batch_size, n_gpus=n_gpus))
    if a.as_json:
        return _echo_json(p)
    text = format_sweep_plan(p, how, weights_here=models.weights_available(a.model))
    if a.estimator not in (None, "atp"):
        text += (f"\n(--estimator {a.estimator}: priced from the weights only; the rows above "
                 "price plain AtP for attribution and the default screen for "
                 "attribution+exact. Run --plan where the weights are for its cost.)")
    if a.method != "auto":
        text += f"\n(--method {a.method}: its row above)"
    typer.echo(text)
