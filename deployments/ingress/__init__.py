"""The ingress: gRPC and OpenAI HTTP front ends, request validation, the status table,
the router client and the warm endpoint.
"""
