"""Generated gRPC stubs for protos/kvmesh/v1 (do not edit; run scripts/gen_protos.sh)."""
