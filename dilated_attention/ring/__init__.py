"""The ring strategy: a rank's block of a call, every pattern run locally or as a ring over the ranks.

``routes.py`` decides how each pattern runs when a call is planned (``plan_ring``); ``block.py`` runs a block's
routes forward and backward (``block_forward``, ``block_backward``); ``kv_ring.py`` passes K/V blocks round a ring;
``layout.py`` says which rank holds which chunks; beside them ``cross_share.py`` (causal rings sharing their cross
blocks), ``square_split.py`` (long causal squares split), ``swapped.py`` (compact rings run head-parallel),
``stacking.py`` (local patterns stacked) and ``side_streams.py``.
"""
