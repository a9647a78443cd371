-- The demo agent's statements (its acme_ticket and acme_comment tables, apart from the
-- runtime's), loaded by db/queries.py as DEMO_QUERIES for db/demo.py. Same format as
-- queries.sql.

-- demo_setup_lock --
SELECT pg_advisory_xact_lock(:k);

-- acme_tables_exist --
SELECT to_regclass('acme_ticket') IS NOT NULL AND to_regclass('acme_comment') IS NOT NULL;

-- seed_acme_tickets --
INSERT INTO acme_ticket (id, title, status, priority, assignee, customer, due_at)
VALUES (:id, :title, :status, :priority, :assignee, :customer,
        now() + make_interval(days => :due_in_days))
ON CONFLICT (id) DO NOTHING;

-- acme_ticket_exists --
SELECT 1 FROM acme_ticket WHERE id = :ticket_id;

-- add_acme_comment --
-- Idempotent by key: a re-executed tool call inserts nothing the second time.
INSERT INTO acme_comment (ticket_id, body, idempotency_key)
VALUES (:ticket_id, :body, :idempotency_key)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id;

-- get_acme_comment_by_key --
SELECT id FROM acme_comment WHERE idempotency_key = :idempotency_key;

-- count_acme_comments --
SELECT count(*) FROM acme_comment WHERE (CAST(:ticket_id AS integer) IS NULL OR ticket_id = :ticket_id);

-- list_acme_tickets --
SELECT id, title, status, priority, assignee, customer, due_at,
       (due_at < now() AND status <> 'closed') AS overdue
FROM acme_ticket
WHERE (CAST(:status AS text) IS NULL OR status = :status)
  AND (CAST(:priority AS text) IS NULL OR priority = :priority)
  AND (CAST(:assignee AS text) IS NULL OR assignee = :assignee)
  AND (CAST(:overdue AS boolean) IS NULL
       OR (due_at < now() AND status <> 'closed') = CAST(:overdue AS boolean))
ORDER BY due_at, id
LIMIT :limit;
