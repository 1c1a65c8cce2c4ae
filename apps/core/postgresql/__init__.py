"""Django's PostgreSQL backend with Klique's pool check; django-tenants' backend is built on it
(settings.ORIGINAL_BACKEND)."""
