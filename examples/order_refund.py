"""order-refund: reserve the refund, ask finance, pay it, or undo the reservation.

When finance rejects, the reservation made before the approval is compensated, exactly once,
and the run ends FAILED with the reason. The "ledger" is the acme demo's ticket comments, so
every effect is a row you can count.

    DAR_AGENT_MODULES=examples.order_refund dar demo --agent order-refund \\
        --input '{"order_id": 105, "amount": 42.5, "reason": "damaged"}' --reject
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from db.demo import TicketStore
from runtime import AgentRegistry
from runtime.durable import Steps, durable_agent


@dataclass
class RefundRequest:
    order_id: int
    amount: float
    reason: str


@dataclass
class Reservation:
    reservation_id: int
    order_id: int
    amount: float


def build(tickets: TicketStore) -> Any:
    def reserve(req: RefundRequest, key: str) -> Reservation:
        comment_id, _ = tickets.add_comment(
            req.order_id, f"reserved {req.amount:.2f} for a refund", idempotency_key=key
        )
        return Reservation(comment_id, req.order_id, req.amount)

    def release(reservation: Reservation, key: str) -> None:
        tickets.add_comment(
            reservation.order_id,
            f"released reservation {reservation.reservation_id}",
            idempotency_key=key,
        )

    def pay(reservation: Reservation, key: str) -> str:
        tickets.add_comment(
            reservation.order_id, f"refunded {reservation.amount:.2f}", idempotency_key=key
        )
        return "paid"

    @durable_agent("order-refund", approval_roles=["finance"])
    def refund(req: RefundRequest, steps: Steps) -> str:
        run = steps.run_id
        reservation = steps.run(
            "reserve",
            lambda: reserve(req, f"refund:{run}:reserve"),
            type=Reservation,
            compensate=lambda r: release(r, f"refund:{run}:release"),
        )
        return steps.approval("finance", 3 * 86400, policy="REJECT").run(
            "pay", pay, reservation, f"refund:{run}:pay", type=str
        )

    return refund


def register(registry: AgentRegistry) -> None:
    registry.register(build(registry.resources["tickets"]))
