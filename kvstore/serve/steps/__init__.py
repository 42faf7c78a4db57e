"""Each request's first generation step: kept as its prompt's canary, or checked against the
canary of the stored prompt it restored (`firststeps`), hooked where mlx_lm.server runs it
(`hooks`), which computes a request again when its restore does not give its canary."""
