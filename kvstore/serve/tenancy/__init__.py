"""Tenants of `kvstore serve`: telling a request's tenant and carrying it to the cache (`policy.py`),
and measuring that tenants cannot tell each other's prompts (`isolation.py`)."""
