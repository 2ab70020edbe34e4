"""Tools that use both sides: the service (``kvindex``) and the worker side (``workers_shim``).

``kvindex`` must never import ``workers_shim`` (the service ships without the worker side), so what
needs both lives here: the ``make run`` demo, the ``make sample-log`` maker and the fault/soak harness.
"""
