-- Records of tenants (`kvstore/tenants.py`): each carries its tenant's tag (16 hex digits, a
-- short HMAC of the tenant's salt; NULL for a shared record, as every row written before this is),
-- and `tenant_totals` keeps each tenant's records and bytes, by the same transactions that change
-- the records, so `stats`, the disk budget and gc read a tenant's size without a scan.
-- The edges in `children` carry the tag too, with an index that starts with (parent, tenant): a
-- lookup reads the children of a shared record that are shared or its tenant's, without walking
-- every other tenant's (under a popular system prompt, thousands).
ALTER TABLE records ADD COLUMN tenant TEXT;
ALTER TABLE children ADD COLUMN tenant TEXT;
CREATE INDEX children_by_tenant ON children (parent, tenant, first_token);

CREATE TABLE tenant_totals (
    tenant  TEXT PRIMARY KEY,
    records INTEGER NOT NULL DEFAULT 0,
    bytes   INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;

CREATE TRIGGER records_tenant_insert AFTER INSERT ON records WHEN new.tenant IS NOT NULL BEGIN
    -- (whichever of this and records_insert runs first, the edge ends up with its tag)
    INSERT OR REPLACE INTO children (parent, first_token, hash, tenant)
    VALUES (new.parent, coalesce(new.first_token, -1), new.hash, new.tenant);
    INSERT OR IGNORE INTO tenant_totals (tenant) VALUES (new.tenant);
    UPDATE tenant_totals SET records = records + 1, bytes = bytes + new.size WHERE tenant = new.tenant;
END;

CREATE TRIGGER records_tenant_delete AFTER DELETE ON records WHEN old.tenant IS NOT NULL BEGIN
    UPDATE tenant_totals SET records = records - 1, bytes = bytes - old.size WHERE tenant = old.tenant;
END;
