import pytest

from controlplane.store.memory import InMemoryEventStore
from tests.store_contract import EventStoreContract


class TestInMemoryEventStore(EventStoreContract):
    @pytest.fixture
    def store(self):
        return InMemoryEventStore()
