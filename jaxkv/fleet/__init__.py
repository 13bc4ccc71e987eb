"""Data-parallel replicas behind a router: the wire protocol (:mod:`jaxkv.fleet.protocol`),
a replica process (:mod:`jaxkv.fleet.replica`), the router (:mod:`jaxkv.fleet.router`)
and its index of what each replica caches (:mod:`jaxkv.fleet.prefix_index`).

Import the submodules directly; the router imports no JAX.
"""
