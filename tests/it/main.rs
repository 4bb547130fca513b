mod handshake;
