"""A --middleware module for the e2e server: adds a header to every response."""


async def add_served_by_header(request, call_next):
    response = await call_next(request)
    response.headers["X-Served-By"] = "tokenloom-e2e"
    return response
