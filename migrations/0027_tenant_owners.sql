-- The tenant whose quota (`tenant_max_bytes`) each salted tenant shares: `kvstore serve
-- --trust-client-salt` makes a tenant of every request's cache_salt (`kvstore.tenants.salted_id`),
-- and all those of one header tenant (or of requests that name none) count against that tenant's
-- one quota. Written (once) in the transaction that stores a salted tenant's records; a tenant
-- with no row here is its own owner. Both columns hold tags (16 hex digits).
CREATE TABLE tenant_owners (
    tenant TEXT PRIMARY KEY,
    owner  TEXT NOT NULL
) WITHOUT ROWID;
