"""Token dispatchers: how the rank's tokens reach their experts (``dispatcher=…``)."""

from dropless.dispatch.base import CommStats, Dispatched, Dispatcher
from dropless.dispatch.local import LocalDispatcher

__all__ = ["CommStats", "Dispatched", "Dispatcher", "LocalDispatcher"]
