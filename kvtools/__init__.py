"""Tools that use both sides: the service (``kvindex``) and the worker side (``workers_shim``).

``kvindex`` must never import ``workers_shim`` (the service ships without the worker side), so what
needs both lives here: the ``make run`` demo, the ``make sample-log`` maker and the fault/soak harness.
"""

import os

# Before grpc is imported: the demo and harnesses start processes beside live channels, and grpcio's
# fork handlers can crash a subprocess.Popen child before it execs (epoll_wait EBADF, SIGABRT;
# grpc/grpc#43055). No forked child here uses gRPC, so fork support is not needed.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
