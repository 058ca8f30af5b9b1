"""Pure decisions: prefill orderings, decode admission, routing scores, autoscaling policy.

Imports only stdlib, numpy and pydantic; never Ray, vLLM, Redis or torch.
"""
