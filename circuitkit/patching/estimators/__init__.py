"""Attribution estimators, one registry entry each (``registry.ENTRIES``), run by one driver.

* ``registry``: ``Estimator`` entries (units, per-batch function, cost, sites, needs and their
  one-line refusals), lookups, ``estimator_passes`` / ``edge_estimator_passes``;
* ``driver``: batches, metric stashes, the finite check, results and meta, heads and edges;
* ``costs``: every estimator's pass-equivalents per prompt, from numbers alone (``plan`` reads
  them too);
* one file per family: ``atp`` (plain, and the Q/K fix's walk), ``qk`` (AtP*'s Q/K fix, its
  per-layer plan, the exact tail), ``block``, ``graddrop`` (and ``atp*``), ``ig``, ``eap``
  (every edge estimator);
* shared pieces: ``common`` (stash, forward runs, writes, scales), ``rerun`` (one layer re-run
  alone, and the probe of whether a bridge allows it).

The public entry points stay ``patching.attribution.attribution_patch_heads`` and
``attribution_patch_edges``; docs/attribution.md and docs/edges.md describe the estimators.
"""
