"""renderqueue: sitemap."""
