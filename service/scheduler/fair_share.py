"""Fair share across tenants (`BLOCKSERVE_SCHEDULING_POLICY=fair`): the Virtual Token Counter.

After Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024). Each tenant has a
counter of the service it received: prompt tokens as its requests are admitted and output tokens
as they are scheduled, each kind at its own cost, divided by the tenant's weight. The waiting
request of the backlogged tenant with the smallest counter goes first, so two backlogged tenants
receive weighted service within a bounded difference of each other. A tenant that becomes active
again is lifted to the smallest counter of the tenants that are active, so idling earns no credit.
Seats and KV blocks follow: a tenant's share of each is its weight over the active tenants'.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TENANTS = 4096  # beyond, the tenants with nothing queued or running are forgotten (a returning one is lifted)


@dataclass(slots=True, eq=False)
class Tenant:
    """One tenant's standing: its weighted service and what it holds or waits for now."""

    name: str
    weight: float = 1.0
    served: float = 0.0  # the virtual counter: weighted tokens served / weight
    num_waiting: int = 0
    num_running: int = 0

    @property
    def is_active(self) -> bool:
        return self.num_waiting > 0 or self.num_running > 0


class FairShare:
    """The tenants the scheduler has seen and their counters; `charge_*` as service is given."""

    def __init__(self, prompt_token_cost: float = 1.0, output_token_cost: float = 2.0):
        self.prompt_token_cost = prompt_token_cost
        self.output_token_cost = output_token_cost
        self.tenants: dict[str, Tenant] = {}

    def tenant(self, name: str, weight: float) -> Tenant:
        """The tenant of that name (made on first sight); its weight is the latest request's."""
        tenant = self.tenants.get(name)
        if tenant is None:
            if len(self.tenants) >= MAX_TENANTS:  # OpenAI's `user` may name a tenant per end user
                self.tenants = {known: t for known, t in self.tenants.items() if t.is_active}
            tenant = self.tenants[name] = Tenant(name, weight)
        tenant.weight = weight
        return tenant

    def lift(self, tenant: Tenant) -> None:
        """A tenant becomes active: no less served than the least served active tenant (no credit for idling)."""
        others = [t.served for t in self.tenants.values() if t is not tenant and t.is_active]
        if others:
            tenant.served = max(tenant.served, min(others))

    def charge_prompt(self, tenant: Tenant, num_tokens: int) -> None:
        tenant.served += self.prompt_token_cost * num_tokens / tenant.weight

    def charge_output(self, tenant: Tenant, num_tokens: int = 1) -> None:
        tenant.served += self.output_token_cost * num_tokens / tenant.weight

    def active(self) -> list[Tenant]:
        return [tenant for tenant in self.tenants.values() if tenant.is_active]

    def shares(self, capacity: float) -> dict[Tenant, float]:
        """Each active tenant's weighted share of `capacity` (seats or blocks)."""
        active = self.active()
        total_weight = sum(tenant.weight for tenant in active)
        return {tenant: capacity * tenant.weight / total_weight for tenant in active}

    def spread(self) -> float:
        """The largest difference between two active tenants' counters (0 with fewer than two)."""
        served = [tenant.served for tenant in self.active()]
        return max(served) - min(served) if len(served) > 1 else 0.0
