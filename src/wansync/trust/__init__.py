"""Trust between the hosts of a run: one home for it (docs/security.md).

- `secret`: the run secret (`--secret-file`, `WANSYNC_SECRET_FILE`) and the keys derived from it;
- `admission`: the HMAC challenge-response every wansync listener runs before anything else;
- `gate`: a listener whose protocol is not ours (c10d's store, torchft's lighthouse) behind admission,
  and the local end its clients connect through;
- `sealed`: everything that crosses between hosts outside a collective, as tensors plus JSON with an
  HMAC checked before anything is parsed (nothing from the network is ever unpickled);
- `listen`: the address every listener binds (`--bind`) and the port range it takes its port from
  (`--ports`).
"""
