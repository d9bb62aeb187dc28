"""Helpers shared by the router's unit tests."""

from __future__ import annotations

from router.admission import Waiting
from router.core import RouterCore
from router.types import RouteDecision, Shed, Ticket


def submit(core: RouterCore, ticket: Ticket) -> Waiting | RouteDecision:
    """``ticket``'s own outcome, a refusal raised (as the service raises it)."""
    outcome = core.submit(ticket).outcome
    if isinstance(outcome, Shed):
        raise outcome
    return outcome
