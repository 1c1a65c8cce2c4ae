"""The MCP server: AI agents and their hosts reach Klique over the Model Context Protocol at each tenant's
`/mcp`, under the identity, role, scope and quota of the Klique token they present."""
