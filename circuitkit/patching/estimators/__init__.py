"""Attribution estimators: one ``registry`` entry each, run by one ``driver``, priced by ``costs``;
one file per family (``atp``, ``qk``, ``block``, ``graddrop``, ``ig``, ``eap``) and shared pieces
(``common``, ``rerun``). Public entry points: ``patching.estimators.attribution``; what each
estimator does: docs/attribution.md and docs/edges.md.
"""
