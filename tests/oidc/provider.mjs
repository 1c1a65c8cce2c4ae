// A real OpenID Connect provider for the SSO tests: node-oidc-provider with its development login
// pages. Everyone may sign in with any password; a login starting with "admin" is in group
// klique-admins, others in researchers; a login starting with "nameless" comes without a
// preferred_username claim. Asked with a resource indicator, it issues JWT access tokens for it.
//   node provider.mjs PORT CLIENT_ID CLIENT_SECRET REDIRECT_URI POST_LOGOUT_URI
import Provider from 'oidc-provider';

const [port, clientId, clientSecret, redirectUri, postLogoutUri] = process.argv.slice(2);

const provider = new Provider(`http://127.0.0.1:${port}`, {
  clients: [{
    client_id: clientId,
    client_secret: clientSecret,
    redirect_uris: [redirectUri],
    post_logout_redirect_uris: [postLogoutUri],
    grant_types: ['authorization_code'],
    response_types: ['code'],
  }],
  claims: {
    openid: ['sub'],
    email: ['email', 'email_verified'],
    profile: ['preferred_username', 'name'],
    groups: ['groups'],
  },
  scopes: ['openid', 'email', 'profile', 'groups', 'read', 'submit'],
  features: {
    devInteractions: { enabled: true },
    rpInitiatedLogout: { enabled: true },
    // Access tokens for a resource (RFC 8707), as an MCP client asks for one: a JWT (RFC 9068) whose
    // audience is the resource, carrying the Klique scopes asked for and the person's name.
    resourceIndicators: {
      enabled: true,
      defaultResource: () => undefined,
      useGrantedResource: () => true,
      getResourceServerInfo: (ctx, resourceIndicator) => ({
        scope: 'read submit',
        audience: resourceIndicator,
        accessTokenTTL: 300,
        accessTokenFormat: 'jwt',
        jwt: { sign: { alg: 'RS256' } },
      }),
    },
  },
  extraTokenClaims: async (ctx, token) => (
    token.accountId && !token.accountId.startsWith('nameless') ? { preferred_username: token.accountId } : {}
  ),
  pkce: { required: () => false },
  cookies: { keys: ['klique-test-only'] },
  findAccount: async (ctx, sub) => ({
    accountId: sub,
    claims: async () => ({
      sub,
      email: `${sub}@example.com`,
      email_verified: true,
      ...(sub.startsWith('nameless') ? {} : { preferred_username: sub }),
      name: sub,
      groups: sub.startsWith('admin') ? ['klique-admins'] : ['researchers'],
    }),
  }),
});
provider.proxy = true;
provider.listen(Number(port), '127.0.0.1', () => console.log(`ready ${port}`));
