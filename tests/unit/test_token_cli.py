"""``dar token new`` (issue 12.8): custom approval roles, a tenant, and no separators in
names; its entries are what the server parses."""

from __future__ import annotations

import pytest

from api.auth import TokenTable
from cli.main import main


def _entry(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["token", "new", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_custom_approval_roles_and_a_tenant(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _entry(capsys, "lead", "--roles", "approve,support_lead", "--tenant", "acme")
    assert code == 0
    token = out.splitlines()[1].strip()
    entry = out.splitlines()[3].strip()
    assert entry.startswith("lead:approve+support_lead:")
    assert entry.endswith(":acme")
    assert "support_lead" in err, "says a custom role must be declared by a durable function"
    principal = TokenTable.parse(entry).authenticate(token)
    assert principal is not None
    assert (principal.name, principal.tenant) == ("lead", "acme")
    assert principal.roles == {"approve", "support_lead"}


@pytest.mark.parametrize("name", ["a:b", "a,b", "a b", ""])
def test_names_with_separators_are_refused(capsys: pytest.CaptureFixture[str], name: str) -> None:
    code, out, err = _entry(capsys, name, "--roles", "read")
    assert code == 2
    assert out == ""
    assert "no ':' or ','" in err


def test_a_tenant_with_separators_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _entry(capsys, "ci", "--roles", "read", "--tenant", "a:b")
    assert code == 2
    assert "--tenant" in err


@pytest.mark.parametrize("roles", ["", "read,bad/role", "re ad"])
def test_malformed_roles_are_refused(capsys: pytest.CaptureFixture[str], roles: str) -> None:
    code, _, err = _entry(capsys, "ci", "--roles", roles)
    assert code == 2
    assert "--roles" in err
