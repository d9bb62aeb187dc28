"""Ray Serve deployments: the ingress (gRPC and OpenAI HTTP) and the vLLM engines."""
