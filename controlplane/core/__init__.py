"""The pure core: fold the log into job views and decide. Standard library and schemas only.

No asyncio, no SQL, no NATS, no torch, and never the clock: time is an argument.
"""

from controlplane.core.fold import fold, fold_jobs
from controlplane.core.records import DeadLetter, StoredEvent
from controlplane.core.view import JobView, Member, MemberStatus

__all__ = ["DeadLetter", "JobView", "Member", "MemberStatus", "StoredEvent", "fold", "fold_jobs"]
