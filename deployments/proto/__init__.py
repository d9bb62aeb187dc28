"""The public gRPC schema ``moecluster.v1`` and its generated stubs (``make proto``)."""
