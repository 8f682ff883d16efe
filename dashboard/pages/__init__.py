"""One module per dashboard page: register_page + layout + its callbacks."""
