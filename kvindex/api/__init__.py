"""The gRPC API (proto/kvindex/v1/kvindex.proto): servicer and server."""
