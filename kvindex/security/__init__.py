"""gRPC transport security for every kvindex server and client: TLS, mutual TLS and a bearer token.

Server side (``kvindex serve``, ``kvindex replay --serve``, any further port such as ext_proc)::

    add_server_options(parser)                     # --tls-cert --tls-key --tls-client-ca --auth-token-file
    security = ServerSecurity.from_args(args)      # or ServerSecurity(ServerTLS(...), token_file=...)
    server = security.new_server(options=[...])    # grpc.aio.server with the token check installed
    port = security.add_port(server, "0.0.0.0:50051")   # TLS port when certificates are given

Client side (``kvindex score|lookup|stats|instances``, ``kvindex.client``)::

    add_client_options(parser)                     # --tls --tls-ca --tls-cert --tls-key --server-name
                                                   # --auth-token-file
    channel = open_channel(address, ClientTLS.from_args(args), token_from_args(args), aio=False)

The token is checked on every RPC except the health service (``grpc.health.v1.Health``: probes
carry no secrets). Reflection needs the token like the API: it lists the whole API surface, and
``grpcurl -H 'authorization: Bearer ...'`` sends it. Certificates and the token file are re-read by
the server when they change on disk (rotation without a restart); clients read them once, when the
channel is opened. The token never reaches a log line, an exception message or a metric.

Modules: ``server`` (``ServerSecurity``, server flags), ``channel`` (``open_channel``, client flags),
``tls`` (certificates), ``tokens`` (the bearer token), ``files`` (reading and watching the files).
Design and failure modes: kvindex/security/README.md.
"""

from kvindex.security.channel import add_client_options, open_channel, token_from_args
from kvindex.security.errors import SecurityConfigError
from kvindex.security.server import ServerSecurity, add_server_options
from kvindex.security.tls import ClientTLS, ServerTLS
from kvindex.security.tokens import read_token

__all__ = [
    "ClientTLS",
    "SecurityConfigError",
    "ServerSecurity",
    "ServerTLS",
    "add_client_options",
    "add_server_options",
    "open_channel",
    "read_token",
    "token_from_args",
]
