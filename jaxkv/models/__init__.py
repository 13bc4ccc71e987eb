"""Models a serving engine runs: the tiny seeded test models and the Gated DeltaNet
serving step (:mod:`jaxkv.models.tiny`, :mod:`jaxkv.models.delta_net`).

Import the submodules directly; this package imports nothing itself.
"""
