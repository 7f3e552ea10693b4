() => window.location.origin + window.location.pathname
