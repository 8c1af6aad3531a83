"""Serving front ends: gRPC plumbing shared by router and workers, the local launcher."""
