"""The fleet page's files (``index.html``, ``dashboard.js``, ``dashboard.css``), served by
:mod:`router.gateway.api.dashboard` from the installed package."""
