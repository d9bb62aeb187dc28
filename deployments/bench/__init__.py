"""The load generator: drives gRPC or OpenAI HTTP endpoints and reports latency."""
