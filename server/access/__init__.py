"""Who may do what: tokens, the API's and the dashboard's authentication, and a caller's project scope."""
