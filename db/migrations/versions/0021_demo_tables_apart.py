"""The acme demo's tables leave the runtime's schema

Earlier releases created acme_ticket (0001) and acme_comment (0003) in every database; the
demo now sets them up itself (db/demo.py: `dar dev` at start, the demo agent's tools on first
use). Here they are dropped where the demo left nothing in them: no comment, and no ticket
but the demo's own seed. Where the demo was used (a comment, a ticket of someone's own) they
stay, and the demo goes on using them; drop them by hand if the database should not hold them
(`DROP TABLE acme_comment, acme_ticket`).

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

# The demo's seed tickets (db/demo.py SEED_TICKETS), fixed here as they were when this ran.
SEED_IDS = (101, 102, 103, 104, 105, 106, 107, 108)


def upgrade() -> None:
    conn = op.get_bind()
    present = conn.execute(
        sa.text(
            "SELECT to_regclass('acme_ticket') IS NOT NULL, "
            "to_regclass('acme_comment') IS NOT NULL"
        )
    ).one()
    tickets, comments = bool(present[0]), bool(present[1])
    if comments and conn.execute(sa.text("SELECT EXISTS (SELECT 1 FROM acme_comment)")).scalar():
        return
    if tickets and conn.execute(
        sa.text("SELECT EXISTS (SELECT 1 FROM acme_ticket WHERE NOT (id = ANY(:ids)))"),
        {"ids": list(SEED_IDS)},
    ).scalar():
        return
    op.execute("DROP TABLE IF EXISTS acme_comment")
    op.execute("DROP TABLE IF EXISTS acme_ticket")


def downgrade() -> None:
    # Nothing to put back: the demo creates its tables where it runs.
    pass
