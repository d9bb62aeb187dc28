"""Ray Serve deployments: the ingress, the engines and their EP groups, built into one
application by ``app``; ``protocol`` is the contract between them.
"""
