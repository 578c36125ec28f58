"""vsrq's HTTP API (Flask). Never imports torch: it stores uploads and enqueues work through `storage`."""
