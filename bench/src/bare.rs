//! `sluice-bench bare-proxy`: the smallest Pingora reverse proxy (one upstream, no policy, no
//! body handling), run in the overhead bench next to Sluice and nginx. It separates what
//! Pingora itself costs on this machine from what Sluice's own request path adds.

use async_trait::async_trait;
use pingora::prelude::*;
use pingora::server::configuration::ServerConf;
use std::net::SocketAddr;

struct Bare {
    upstream: SocketAddr,
}

#[async_trait]
impl ProxyHttp for Bare {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn upstream_peer(&self, _s: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new(self.upstream, false, String::new())))
    }
}

/// Runs until killed; Pingora owns the process's runtimes, so this is called outside tokio.
pub fn run(listen: &str, upstream: SocketAddr, threads: usize) -> ! {
    let conf = ServerConf {
        threads,
        ..Default::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut proxy = pingora::proxy::http_proxy_service(&server.configuration, Bare { upstream });
    proxy.add_tcp(listen);
    server.add_service(proxy);
    server.run_forever()
}
