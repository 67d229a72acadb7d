"""The ``--plan`` text of ``patching.cost``'s plans: ``format_sweep_plan`` (``patch --plan``
from the config), ``format_edge_plan`` (``edges --plan``) and ``duration`` (seconds as the CLI
says them, ``circuitkit info`` too).
"""

from __future__ import annotations

from typing import Any

from circuitkit.patching import cost


def format_sweep_plan(p: dict[str, Any], tokens_from: str = "",
                      weights_here: bool = False) -> str:
    """The ``--plan`` text of a ``sweep_plan`` dict (planned from the config: no weights, or
    ``weights_here`` and hypothetical prompts, ``--seq-len``)."""
    gb = 1e9
    cells = f"{p['n_layers']} layers x {p['n_units']} heads" + (
        f" x {p['n_pos']} positions" if p["n_pos"] > 1 else "")
    lines = [
        f"model        {p['model']} ({p['n_params'] / 1e9:.2f} B parameters; planned from its "
        + ("config)" if weights_here else "config, no weights on this machine)"),
        f"sweep        {cells} = {p['n_cells']:,} cells, site {p['site']}, {p['direction']}",
        f"prompts      {p['n_prompts']} of up to {p['seq']} tokens (mean {p['mean_tokens']:.1f})"
        + (f"; {tokens_from}" if tokens_from else ""),
        f"weights      {p['weights_bytes'] / gb:,.1f} GB ({p['dtype_bytes'] * 8}-bit: "
        f"{p['n_params']:,} x {p['dtype_bytes']} bytes)",
        f"GPUs         {p['n_gpus']} x {p['gpu']} per replica "
        f"({p['weights_bytes'] / p['n_gpus'] / gb:,.1f} GB of weights each, "
        f"{p['activation_budget_bytes'] / gb:,.1f} GB each for activations)"
        + (f"; {p['replicas']} replicas" if p["replicas"] > 1 else ""),
        f"host RAM     {p['host_cache_bytes'] / gb:,.1f} GB for the exact engine's cached "
        "activations (CPU)",
        f"time basis   bf16 dense peak {p['peak_flops'] / 1e12:,.0f} TFLOP/s x "
        f"{p['utilisation']:.0%} utilisation"
        + (f" x {p['replicas']} replicas" if p["replicas"] > 1 else " (one replica: a model "
           "split by layers computes on one GPU at a time)"),
        "",
        f"{'method':<25} {'pass-equiv.':>12} {'PFLOP':>10} {'activations':>13} {'chunk':>7} "
        f"{'chunks':>8} {'time':>10}",
    ]
    for name, m in p["methods"].items():
        label = name if name != "attribution+exact" else (
            f"attribution+exact@{m['verified_cells']}" if m["budget"] == "top_k"
            else f"attribution+exact@~{m['verified_cells']}")
        unit = "rows" if name == "exact" else "prompts"
        lines.append(
            # every column after a space: wide numbers (per-position sweeps) never run together
            f"{label:<25} {m['pass_equivalents']:>12,.0f} {m['flops'] / 1e15:>10,.1f} "
            f"{m['activation_bytes'] / gb:>10,.1f} GB {m['rows']:>7,} {m['n_chunks']:>8,} "
            f"{duration(m['seconds']):>10}" + (f"  ({unit} per forward)" if name == "exact"
                                                 else ""))
    hy = p["methods"]["attribution+exact"]
    if hy["budget"] == "auto":
        lines.append(f"{'':<25}verifies as many cells as its error bound asks "
                     f"(~{cost.AUTO_EXPECTED_FRACTION:.0%} expected; at most "
                     f"{hy['verified_cells_max']:,}: {duration(hy['seconds_max'])})")
    lines += [
        "",
        f"--method auto picks {p['auto']} (exact sweep: {p['exact_flops_per_token']:.2g} FLOPs per "
        f"prompt token; exact at or below {cost.AUTO_EXACT_MAX_FLOPS_PER_TOKEN:.0e})",
        "pass-equivalent: one prompt through the whole model (a backward counts 2); "
        "attribution's chunk is prompts per backward",
    ]
    return "\n".join(lines)


def duration(seconds: float) -> str:
    """Seconds as the plans print them: s, min or h, one decimal."""
    if seconds < 0.05:  # not "0.0 s": a time too small to print at this resolution
        return "<0.1 s"
    if seconds < 120:
        return f"{seconds:,.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds / 3600:,.1f} h"


def format_edge_plan(p: dict[str, Any], tokens_from: str = "") -> str:
    """The ``circuitkit edges --plan`` text of an ``edge_plan`` dict. Optional keys the CLI
    adds: ``measured`` (the parameters were counted on the loaded weights), ``chosen`` (the
    row of ``--method`` / ``--estimator``, marked), ``top_k_hint`` ((k, the hybrid's row at
    ``top_k=k``): what a smaller verification budget costs)."""
    gb, n = 1e9, p["n_params"]
    size = f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else \
        f"{n / 1e3:.0f} k"
    source = ("the weights are here: parameters and prompts measured" if p.get("measured")
              else "planned from its config, no weights needed")
    lines = [
        f"model        {p['model']} ({size} parameters; {source})",
        f"edges        {p['n_senders']:,} senders x {p['n_receivers']:,} receivers, inputs "
        f"{','.join(p['inputs'])}: {p['n_edges']:,} edges",
        f"prompts      {p['n_prompts']} of up to {p['seq']} tokens (mean {p['mean_tokens']:.1f})"
        + (f"; {tokens_from}" if tokens_from else ""),
        f"weights      {p['weights_bytes'] / gb:,.1f} GB on {p['n_gpus']} x {p['gpu']}",
        f"host RAM     {p['host_cache_bytes'] / gb:,.1f} GB for the exact engine's cached "
        f"activations; results {p['results_bytes'] / gb:,.2f} GB (per-prompt values)",
        f"time basis   {p['gpu']} (--gpu): bf16 dense peak {p['peak_flops'] / 1e12:,.0f} "
        f"TFLOP/s x {p['utilisation']:.0%} utilisation",
        "             (GPU time only, there is no CPU class: on a CPU, time a run with a small -n)",
        "",
        f"{'method':<26} {'pass-equiv.':>14} {'PFLOP':>11} {'GPU time':>10}",
    ]
    chosen = p.get("chosen")
    for name, m in p["methods"].items():
        label = "TL direct-path loop" if name == "TL loop" else (
            f"attribution+exact@{m['verified_edges']:,}" if name == "attribution+exact"
            else name)
        if name.startswith("eap-ig"):
            label += f" (m={p['ig_steps']})"
        mark = "  <- --method" if name == chosen else ""
        lines.append(f"{label:<26} {m['pass_equivalents']:>14,.0f} {m['flops'] / 1e15:>11,.1f} "
                     f"{duration(m['seconds']):>10}{mark}")
    lines += ["", "pass-equivalent: one prompt through the whole model (a backward counts 2)",
              f"TL's loop: one forward per head -> head edge it supports ({p['head_edges']:,}; "
              "q only under GQA) and prompt"]
    if p.get("top_k_hint"):
        (k, m), full = p["top_k_hint"], p["methods"]["attribution+exact"]["verified_edges"]
        lines.append(f"attribution+exact verifies {full:,} edges by default (the screen's error "
                     f"bound); --top-k {k} verifies {k}: {m['pass_equivalents']:,.0f} "
                     f"pass-equivalents, {duration(m['seconds'])}")
    return "\n".join(lines)
