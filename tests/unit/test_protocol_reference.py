"""docs/ARCHITECTURE.md's table of messages is the protocol module's, regenerated."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

from sdpipe_cli.runtime import protocol, protocol_reference

PAGE = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"


def test_the_page_shows_the_current_messages():
    page = PAGE.read_text()
    assert page.count(protocol_reference.BEGIN) == 1 and page.count(protocol_reference.END) == 1
    assert protocol_reference.replaced(page) == page, (
        "docs/ARCHITECTURE.md is stale: python -m sdpipe_cli.runtime.protocol_reference "
        "--write docs/ARCHITECTURE.md")


def test_every_message_has_a_route():
    # fields of messages (of Group, of MeetingChoice), not messages of their own
    parts = {protocol.HealTarget, protocol.StageLink}
    messages = {cls for _, cls in inspect.getmembers(protocol, inspect.isclass)
                if dataclasses.is_dataclass(cls) and cls.__module__ == protocol.__name__}
    assert messages - parts == set(protocol.ROUTES)
    table = protocol_reference.table()
    for cls in protocol.ROUTES:
        assert cls.__name__ in table or f"`{cls.type}`" in table
